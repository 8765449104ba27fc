//! roce-trace's kernel boundary and packet sources: the embedded eBPF object loaded,
//! attached and read ([`loader`]), the host checks it needs ([`sys`]), mirror sessions
//! ([`mirror`]), pcap/pcapng input through the same parser and accounting ([`pcap`]),
//! the records `capture` prints ([`record`]), the kernel's own drop counters
//! ([`netstat`]) and the readers' periodic timer ([`timer`]). The only crate whose build
//! script builds the eBPF object.

pub mod loader;
pub mod mapped;
pub mod mirror;
pub mod netstat;
pub mod nic;
pub mod pcap;
pub mod rdma_netlink;
pub mod record;
pub mod sys;
pub mod timer;
