#![no_std]
// The programs are the `roce-trace` binary target (src/main.rs); this empty library lets
// roce-trace name this crate as a build-dependency so cargo rebuilds it on change.
