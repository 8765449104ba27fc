//! roce-trace's RoCEv2 generator: frames built from the shared header definitions with
//! a correct ICRC ([`frame`], also the mirror encapsulations and test input for the
//! datapath), and RC/UD traffic with go-back-N, DCQCN and a responder ([`traffic`]) —
//! the virtual fabric's load and the probes' packets.

pub mod frame;
pub mod traffic;
