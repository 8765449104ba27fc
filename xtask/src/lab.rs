//! `cargo xtask lab up|down|status|fault|clear`: the virtual leaf-spine fabric.

use clap::{Args, Subcommand};
use roce_trace_lab::{Fault, Lab};

#[derive(Args)]
pub struct LabArgs {
    /// Namespace prefix (several labs can coexist).
    #[arg(long, default_value = "rtlab", global = true)]
    prefix: String,
    #[command(subcommand)]
    cmd: LabCmd,
}

#[derive(Subcommand)]
enum LabCmd {
    /// Build the fabric (a lab already up is left as it is).
    Up {
        /// MTU of every link.
        #[arg(long, default_value_t = 1500)]
        mtu: u32,
        /// ECMP hash seed on the leaves (which source ports take which spine).
        #[arg(long, default_value_t = 1)]
        seed: u32,
    },
    /// Remove every namespace, link and rule of the lab.
    Down,
    /// Nodes, interfaces and active faults.
    Status,
    /// Switch a fault on.
    Fault {
        #[command(subcommand)]
        fault: FaultArg,
    },
    /// Switch a fault off.
    Clear {
        #[command(subcommand)]
        fault: FaultArg,
    },
}

#[derive(Subcommand, Clone)]
enum FaultArg {
    /// A spine remarks RDMA traffic as it arrives.
    DscpRewrite {
        #[arg(long)]
        spine: u8,
        #[arg(long, default_value_t = 26)]
        from: u8,
        #[arg(long, default_value_t = 0)]
        to: u8,
    },
    /// CE-mark a share of the ECN-capable RoCE packets leaving NODE by IFACE.
    CeMark {
        #[arg(long)]
        node: String,
        #[arg(long)]
        iface: String,
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=100))]
        percent: u8,
    },
    /// Rate-limit NODE's IFACE (tc tbf rate, e.g. 100mbit).
    Bottleneck {
        #[arg(long)]
        node: String,
        #[arg(long)]
        iface: String,
        #[arg(long, default_value = "100mbit")]
        rate: String,
    },
    /// Take the link between leaf L and spine S down.
    LinkDown {
        #[arg(long)]
        leaf: u8,
        #[arg(long)]
        spine: u8,
    },
    /// Take the link between leaf L and spine S down with no routing protocol: L stops
    /// using S, the other leaf keeps sending L's traffic to S, which drops it (replies
    /// to L's hosts through S are black-holed).
    LinkDownStatic {
        #[arg(long)]
        leaf: u8,
        #[arg(long)]
        spine: u8,
    },
    /// Take every port of a spine down.
    SpineDown {
        #[arg(long)]
        spine: u8,
    },
    /// Lower the MTU of the link between leaf L and spine S.
    Mtu {
        #[arg(long)]
        leaf: u8,
        #[arg(long)]
        spine: u8,
        #[arg(long, default_value_t = 1000)]
        mtu: u32,
    },
    /// ECMP imbalance: leaf L hashes on addresses only, so a host pair's flows share a spine.
    EcmpL3 {
        #[arg(long)]
        leaf: u8,
    },
    /// Leaf L drops every CNP arriving from the spines (DCQCN dead for its hosts).
    CnpDrop {
        #[arg(long)]
        leaf: u8,
    },
    /// Remark only what a leaf's hosts send (one direction).
    AsymClass {
        #[arg(long)]
        leaf: u8,
        #[arg(long, default_value_t = 26)]
        from: u8,
        #[arg(long, default_value_t = 0)]
        to: u8,
    },
}

fn fault(f: FaultArg) -> anyhow::Result<Fault> {
    let check = |ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(anyhow::anyhow!("{what}"))
        }
    };
    Ok(match f {
        FaultArg::DscpRewrite { spine, from, to } => {
            check((1..=2).contains(&spine), "spines are 1 and 2")?;
            check(from < 64 && to < 64, "DSCP is 0..=63")?;
            Fault::DscpRewrite { spine, from, to }
        }
        FaultArg::CeMark { node, iface, percent } => Fault::CeMark { node, iface, percent },
        FaultArg::Bottleneck { node, iface, rate } => Fault::Bottleneck { node, iface, rate },
        FaultArg::LinkDown { leaf, spine } => {
            check(
                (1..=2).contains(&leaf) && (1..=2).contains(&spine),
                "leaves and spines are 1 and 2",
            )?;
            Fault::LinkDown { leaf, spine }
        }
        FaultArg::LinkDownStatic { leaf, spine } => {
            check(
                (1..=2).contains(&leaf) && (1..=2).contains(&spine),
                "leaves and spines are 1 and 2",
            )?;
            Fault::LinkDownStatic { leaf, spine }
        }
        FaultArg::SpineDown { spine } => {
            check((1..=2).contains(&spine), "spines are 1 and 2")?;
            Fault::SpineDown { spine }
        }
        FaultArg::Mtu { leaf, spine, mtu } => {
            check(
                (1..=2).contains(&leaf) && (1..=2).contains(&spine),
                "leaves and spines are 1 and 2",
            )?;
            check((576..=9000).contains(&mtu), "MTU is 576..=9000")?;
            Fault::Mtu { leaf, spine, mtu }
        }
        FaultArg::EcmpL3 { leaf } => {
            check((1..=2).contains(&leaf), "leaves are 1 and 2")?;
            Fault::EcmpL3 { leaf }
        }
        FaultArg::CnpDrop { leaf } => {
            check((1..=2).contains(&leaf), "leaves are 1 and 2")?;
            Fault::CnpDrop { leaf }
        }
        FaultArg::AsymClass { leaf, from, to } => {
            check((1..=2).contains(&leaf), "leaves are 1 and 2")?;
            check(from < 64 && to < 64, "DSCP is 0..=63")?;
            Fault::AsymClass { leaf, from, to }
        }
    })
}

pub fn run(a: LabArgs) -> anyhow::Result<()> {
    let mut lab = Lab {
        prefix: a.prefix,
        ..Lab::default()
    };
    match a.cmd {
        LabCmd::Up { mtu, seed } => {
            lab.mtu = mtu;
            lab.seed = seed;
            let was_up = lab.is_up()?;
            lab.up()?;
            println!("{}", if was_up { "lab already up" } else { "lab up" });
            print!("{}", lab.status()?);
        }
        LabCmd::Down => {
            lab.down()?;
            println!("lab down");
        }
        LabCmd::Status => print!("{}", lab.status()?),
        LabCmd::Fault { fault: f } => {
            anyhow::ensure!(lab.is_up()?, "the lab is not up (cargo xtask lab up)");
            let f = fault(f)?;
            lab.apply(&f)?;
            println!("fault on: {f:?}");
        }
        LabCmd::Clear { fault: f } => {
            anyhow::ensure!(lab.is_up()?, "the lab is not up (cargo xtask lab up)");
            let f = fault(f)?;
            lab.clear(&f)?;
            println!("fault off: {f:?}");
        }
    }
    Ok(())
}
