//! roce-trace: what a RoCE fabric does to RDMA traffic.
//!
//! Stages, one direction: parse + count/sample in the kernel (`roce-trace-ebpf`, loaded by
//! [`datapath`]) → observe ([`record`], [`capture`], [`agent`], [`pcap`]) → correlate
//! ([`collector`], [`correlate`]) → judge ([`verify`]) → report.

pub mod agent;
pub mod budget;
pub mod capture;
pub mod collector;
pub mod fleet;
#[doc(hidden)]
pub mod fuzz_api;
pub mod http;
pub mod local;
pub mod metrics;
pub mod nic;
pub mod observation;
pub mod privilege;
pub mod protocol;
pub mod tls;
pub mod trace;
pub mod verdicts;

pub use roce_trace_correlate as correlate;
pub use roce_trace_datapath::{loader as datapath, netstat, pcap, rdma_netlink, record, sys, timer};
pub use roce_trace_gen::{frame, traffic};
pub use roce_trace_report as pictures;
pub use roce_trace_verify as verify;
