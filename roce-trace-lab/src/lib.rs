//! The virtual fabric: a two-tier leaf-spine network of Linux namespaces (2 spines, 2
//! leaves, 4 hosts) routed in IPv4 and IPv6, leaves hashing L4 (the UDP source port picks
//! the spine), and faults switched on and off by name. Everything it creates is named
//! with its prefix, so `down` removes exactly what `up` made.
//!
//! ```text
//!        s1            s2
//!        |  \        /  |
//!        |    \    /    |
//!        |     \  /     |
//!        l1 ---/  \---  l2        (every leaf links to every spine)
//!       /  \          /  \
//!     h1    h2      h3    h4
//! ```
//!
//! Addressing: host N is 10.10.N.2/24 (gateway .1) and fd00:10:N::2/64; the link between
//! leaf X and spine Y is 10.2X.Y.0/24 (leaf .1, spine .2) and fd00:2X:Y::/64. Interfaces
//! are named after their peer: `eth0` on a host, `h1`/`s1` on a leaf, `l1` on a spine.

pub mod nic_fixture;

use std::{net::IpAddr, process::Command};

/// Why a lab step failed: the command it ran and what that command said.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("running {cmd}: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{cmd} failed: {stderr}{}", if .input.is_empty() { String::new() } else { format!("\n{}", .input) })]
    Failed {
        cmd: String,
        stderr: String,
        /// What the command read on stdin (a batch, an nft script), for the reader.
        input: String,
    },
    #[error("{0}")]
    Unexpected(String),
}

pub type Result<T, E = LabError> = std::result::Result<T, E>;

pub const HOSTS: [u8; 4] = [1, 2, 3, 4];
pub const LEAVES: [u8; 2] = [1, 2];
pub const SPINES: [u8; 2] = [1, 2];
/// Where a collector listens, on the management network (`mgmt` namespace).
pub const MGMT_COLLECTOR: &str = "10.255.0.1";

/// The leaf a host hangs off.
pub fn leaf_of(host: u8) -> u8 {
    if host <= 2 { 1 } else { 2 }
}

#[derive(Clone, Debug)]
pub struct Lab {
    pub prefix: String,
    /// MTU of every link.
    pub mtu: u32,
    /// fib_multipath_hash_seed: which source ports map to which spine.
    pub seed: u32,
}

impl Default for Lab {
    fn default() -> Self {
        Self {
            prefix: "rtlab".into(),
            mtu: 1500,
            seed: 1,
        }
    }
}

/// A fault the lab can switch on and off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A spine remarks RDMA traffic (DSCP `from` → `to`) as it arrives.
    DscpRewrite { spine: u8, from: u8, to: u8 },
    /// A congested queue: `percent` of ECN-capable RoCE packets leaving `node` by `iface`
    /// are CE-marked.
    CeMark {
        node: String,
        iface: String,
        percent: u8,
    },
    /// A rate-limited link: token bucket on `node`'s `iface`.
    Bottleneck {
        node: String,
        iface: String,
        rate: String,
    },
    /// The link between a leaf and a spine, both ends administratively down; routes
    /// converge at once, as a routing protocol would have them.
    LinkDown { leaf: u8, spine: u8 },
    /// The same link failure in a fabric without a routing protocol: the link's two ends
    /// stop using it (the leaf's ECMP next hop dies, the spine's route to the leaf's hosts
    /// goes), but the other leaf is not told and keeps hashing traffic to `leaf`'s hosts
    /// onto `spine`, which drops it. Traffic from `leaf` moves; traffic to it through
    /// `spine` — the replies of its hosts' connections — is black-holed.
    LinkDownStatic { leaf: u8, spine: u8 },
    /// Every port of a spine down.
    SpineDown { spine: u8 },
    /// A leaf–spine link with a smaller MTU (both ends).
    Mtu { leaf: u8, spine: u8, mtu: u32 },
    /// One direction only is remarked: traffic entering `leaf` from its hosts.
    AsymClass { leaf: u8, from: u8, to: u8 },
    /// ECMP imbalance: `leaf` hashes on addresses only (L3), so every flow of a host pair
    /// takes the same spine whatever its UDP source port.
    EcmpL3 { leaf: u8 },
    /// CNPs in a dropped queue: `leaf` drops every CNP (BTH opcode 0x81) arriving from
    /// the spines, so no sender behind it is told to slow down.
    CnpDrop { leaf: u8 },
}

impl Fault {
    /// Short name, used for the nftables table that implements it.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::DscpRewrite { .. } => "dscp_rewrite",
            Fault::CeMark { .. } => "ce_mark",
            Fault::Bottleneck { .. } => "bottleneck",
            Fault::LinkDown { .. } => "link_down",
            Fault::LinkDownStatic { .. } => "link_down_static",
            Fault::SpineDown { .. } => "spine_down",
            Fault::Mtu { .. } => "mtu",
            Fault::AsymClass { .. } => "asym_class",
            Fault::EcmpL3 { .. } => "ecmp_l3",
            Fault::CnpDrop { .. } => "cnp_drop",
        }
    }
}

fn run(args: &[&str]) -> Result<String> {
    run_with_input(args, "")
}

/// Runs `args`, writing `input` to its stdin (none when empty); its stdout, or why not.
fn run_with_input(args: &[&str], input: &str) -> Result<String> {
    use std::{io::Write, process::Stdio};
    let cmd = || args.join(" ");
    let spawn = |source| LabError::Spawn { cmd: cmd(), source };
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(if input.is_empty() {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes()).map_err(spawn)?;
    }
    let out = child.wait_with_output().map_err(spawn)?;
    if !out.status.success() {
        return Err(LabError::Failed {
            cmd: cmd(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            input: input.to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Lab {
    pub fn ns(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }

    /// Runs a command in a lab node (`h1`, `l2`, `s1`, …).
    pub fn exec(&self, node: &str, args: &[&str]) -> Result<String> {
        let ns = self.ns(node);
        let mut full = vec!["ip", "netns", "exec", &ns];
        full.extend_from_slice(args);
        run(&full)
    }

    /// Every node: spines, leaves, hosts.
    pub fn nodes() -> Vec<String> {
        let mut v: Vec<String> = SPINES.iter().map(|s| format!("s{s}")).collect();
        v.extend(LEAVES.iter().map(|l| format!("l{l}")));
        v.extend(HOSTS.iter().map(|h| format!("h{h}")));
        v
    }

    pub fn host_ip(host: u8, v6: bool) -> IpAddr {
        if v6 {
            format!("fd00:10:{host}::2").parse().unwrap()
        } else {
            format!("10.10.{host}.2").parse().unwrap()
        }
    }

    fn existing(&self) -> Result<Vec<String>> {
        let out = run(&["ip", "netns", "list"])?;
        let p = format!("{}-", self.prefix);
        Ok(out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&p))
            .map(str::to_owned)
            .collect())
    }

    pub fn is_up(&self) -> Result<bool> {
        let have = self.existing()?;
        Ok(Self::nodes()
            .iter()
            .chain(std::iter::once(&"mgmt".to_owned()))
            .all(|n| have.contains(&self.ns(n))))
    }

    /// Builds the fabric; a lab that is already up is left as it is.
    pub fn up(&self) -> Result<()> {
        if self.is_up()? {
            return Ok(());
        }
        self.down()?; // a partial lab from an interrupted run
        for n in Self::nodes() {
            run(&["ip", "netns", "add", &self.ns(&n)])?;
            self.exec(&n, &["ip", "link", "set", "lo", "up"])?;
            let router = !n.starts_with('h');
            let mut sysctls = vec![
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
                "net.ipv6.conf.all.keep_addr_on_down=1",
                "net.ipv6.conf.default.keep_addr_on_down=1",
                "net.ipv6.conf.all.accept_ra=0",
                "net.ipv6.conf.default.accept_ra=0",
            ];
            if router {
                sysctls.extend([
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                    "net.ipv4.fib_multipath_hash_policy=1",
                    "net.ipv6.fib_multipath_hash_policy=1",
                    "net.ipv4.conf.all.ignore_routes_with_linkdown=1",
                    "net.ipv6.conf.all.ignore_routes_with_linkdown=1",
                    "net.ipv4.icmp_ratelimit=0",
                    "net.ipv4.icmp_msgs_per_sec=100000",
                    "net.ipv4.icmp_msgs_burst=10000",
                    "net.ipv6.icmp.ratelimit=0",
                    "net.ipv4.icmp_errors_use_inbound_ifaddr=1",
                ]);
            } else {
                // Otherwise the sender's skb hash crosses the veth and the leaf hashes on it.
                sysctls.push("net.ipv6.auto_flowlabels=0");
                // Port unreachable answers to every probe (traces end there).
                sysctls.extend(["net.ipv4.icmp_ratelimit=0", "net.ipv6.icmp.ratelimit=0"]);
            }
            let mut args = vec!["sysctl", "-qw"];
            args.extend(sysctls);
            self.exec(&n, &args)?;
            if router {
                let seed = format!("net.ipv4.fib_multipath_hash_seed={}", self.seed);
                // Older kernels lack the seed; the map is then the kernel's own.
                let _ = self.exec(&n, &["sysctl", "-qw", &seed]);
            }
        }
        let mtu = self.mtu.to_string();
        // Hosts to leaves.
        for h in HOSTS {
            let l = leaf_of(h);
            self.veth(&format!("h{h}"), "eth0", &format!("l{l}"), &format!("h{h}"), &mtu)?;
            self.addr(
                &format!("h{h}"),
                "eth0",
                &format!("10.10.{h}.2/24"),
                &format!("fd00:10:{h}::2/64"),
            )?;
            self.addr(
                &format!("l{l}"),
                &format!("h{h}"),
                &format!("10.10.{h}.1/24"),
                &format!("fd00:10:{h}::1/64"),
            )?;
            // IPv6 UDP checksums go wrong across veth with tx offload on (LAB_NOTES).
            self.exec(&format!("h{h}"), &["ethtool", "-K", "eth0", "tx", "off"])?;
        }
        // Leaves to spines.
        for l in LEAVES {
            for s in SPINES {
                self.veth(
                    &format!("l{l}"),
                    &format!("s{s}"),
                    &format!("s{s}"),
                    &format!("l{l}"),
                    &mtu,
                )?;
                self.addr(
                    &format!("l{l}"),
                    &format!("s{s}"),
                    &format!("10.2{l}.{s}.1/24"),
                    &format!("fd00:2{l}:{s}::1/64"),
                )?;
                self.addr(
                    &format!("s{s}"),
                    &format!("l{l}"),
                    &format!("10.2{l}.{s}.2/24"),
                    &format!("fd00:2{l}:{s}::2/64"),
                )?;
            }
        }
        self.mgmt()?;
        for n in Self::nodes() {
            for ifname in self.interfaces(&n)? {
                self.exec(&n, &["ip", "link", "set", &ifname, "up"])?;
            }
        }
        self.routes()
    }

    /// The out-of-band management network: every node's `mgmt` port on one bridge in the
    /// `mgmt` namespace (10.255.0.1), where a collector listens apart from the fabric.
    fn mgmt(&self) -> Result<()> {
        run(&["ip", "netns", "add", &self.ns("mgmt")])?;
        self.exec("mgmt", &["ip", "link", "set", "lo", "up"])?;
        self.exec("mgmt", &["ip", "link", "add", "br0", "type", "bridge"])?;
        self.exec(
            "mgmt",
            &["ip", "addr", "add", &format!("{MGMT_COLLECTOR}/24"), "dev", "br0"],
        )?;
        self.exec("mgmt", &["ip", "link", "set", "br0", "up"])?;
        for n in Self::nodes() {
            let port = format!("m{n}");
            self.veth(&n, "mgmt", "mgmt", &port, "1500")?;
            self.exec("mgmt", &["ip", "link", "set", &port, "master", "br0"])?;
            self.exec("mgmt", &["ip", "link", "set", &port, "up"])?;
            self.exec(
                &n,
                &[
                    "ip",
                    "addr",
                    "add",
                    &format!("{}/24", Self::mgmt_addr(&n)),
                    "dev",
                    "mgmt",
                ],
            )?;
        }
        Ok(())
    }

    /// A node's address on the management network.
    pub fn mgmt_addr(node: &str) -> String {
        let k = Self::nodes().iter().position(|n| n == node).expect("a lab node") + 11;
        format!("10.255.0.{k}")
    }

    fn veth(&self, a: &str, a_if: &str, b: &str, b_if: &str, mtu: &str) -> Result<()> {
        // Temporary names in the root namespace must not collide with anything there.
        let (ta, tb) = (
            format!("{}{a}{a_if}", self.prefix),
            format!("{}{b}{b_if}", self.prefix),
        );
        let (ta, tb) = (&ta[..ta.len().min(15)], &tb[..tb.len().min(15)]);
        run(&[
            "ip",
            "link",
            "add",
            ta,
            "mtu",
            mtu,
            "netns",
            &self.ns(a),
            "type",
            "veth",
            "peer",
            "name",
            tb,
            "mtu",
            mtu,
            "netns",
            &self.ns(b),
        ])?;
        self.exec(a, &["ip", "link", "set", ta, "name", a_if])?;
        self.exec(b, &["ip", "link", "set", tb, "name", b_if])?;
        Ok(())
    }

    fn addr(&self, node: &str, ifname: &str, v4: &str, v6: &str) -> Result<()> {
        self.exec(node, &["ip", "addr", "add", v4, "dev", ifname])?;
        self.exec(node, &["ip", "-6", "addr", "add", v6, "dev", ifname, "nodad"])?;
        Ok(())
    }

    /// Interfaces of a node other than lo (the fabric ports and `mgmt`).
    pub fn interfaces(&self, node: &str) -> Result<Vec<String>> {
        let out = self.exec(node, &["ls", "/sys/class/net"])?;
        Ok(out
            .split_whitespace()
            .filter(|i| *i != "lo")
            .map(str::to_owned)
            .collect())
    }

    /// `roce-trace agent` arguments for `node`, observing all its fabric ports, streaming
    /// to `collector` (the same sampling on every node, as consistent sampling needs).
    pub fn agent_args(
        &self,
        node: &str,
        collector: &str,
        token: &str,
        sample_rate: u32,
    ) -> Result<Vec<String>> {
        let mut args: Vec<String> = [
            "agent",
            "--collector",
            collector,
            "--node",
            node,
            "--token",
            token,
        ]
        .into_iter()
        .map(String::from)
        .collect();
        args.extend(["--sample-rate".into(), sample_rate.to_string()]);
        args.extend(["--interval", "1s", "--expect-dscp", "26,48"].map(String::from));
        for p in self.fabric_ports(node)? {
            args.push("-i".into());
            args.push(p);
        }
        Ok(args)
    }

    /// The fabric ports of a node: what an agent there observes.
    pub fn fabric_ports(&self, node: &str) -> Result<Vec<String>> {
        Ok(self
            .interfaces(node)?
            .into_iter()
            .filter(|i| i != "mgmt")
            .collect())
    }

    /// (Re)installs every route (idempotent), as a routing protocol would: a leaf reaches
    /// the other leaf's hosts through every spine whose links to both leaves are up. (Admin
    /// down of a port also deletes the IPv4 routes through it, so this runs after every
    /// link change.) One `ip -batch` per node, the leaves first: their next hops are what
    /// a link change moves, and a routing protocol converges in a fraction of a second —
    /// the replies of a leaf's hosts must not stay on a dead link longer than that.
    pub fn routes(&self) -> Result<()> {
        let mut up = std::collections::BTreeSet::new();
        let mut ports_up = std::collections::BTreeMap::new();
        for n in LEAVES
            .iter()
            .map(|l| format!("l{l}"))
            .chain(SPINES.iter().map(|s| format!("s{s}")))
        {
            ports_up.insert(n.clone(), self.ports_up(&n)?);
        }
        for l in LEAVES {
            for s in SPINES {
                if ports_up[&format!("l{l}")].contains(&format!("s{s}"))
                    && ports_up[&format!("s{s}")].contains(&format!("l{l}"))
                {
                    up.insert((l, s));
                }
            }
        }
        for l in LEAVES {
            let leaf = format!("l{l}");
            let mut batch = Vec::new();
            for h in HOSTS.iter().filter(|&&h| leaf_of(h) != l) {
                let via: Vec<u8> = SPINES
                    .iter()
                    .copied()
                    .filter(|&s| up.contains(&(l, s)) && up.contains(&(leaf_of(*h), s)))
                    .collect();
                if via.is_empty() {
                    // Cut off, as a real leaf would be.
                    let _ = self.exec(&leaf, &["ip", "route", "del", &format!("10.10.{h}.0/24")]);
                    let _ = self.exec(&leaf, &["ip", "-6", "route", "del", &format!("fd00:10:{h}::/64")]);
                    continue;
                }
                let (mut v4, mut v6) = (
                    format!("route replace 10.10.{h}.0/24"),
                    format!("route replace fd00:10:{h}::/64"),
                );
                for s in via {
                    v4.push_str(&format!(" nexthop via 10.2{l}.{s}.2 dev s{s}"));
                    v6.push_str(&format!(" nexthop via fd00:2{l}:{s}::2 dev s{s}"));
                }
                batch.extend([v4, v6]);
            }
            self.ip_batch(&leaf, &batch)?;
        }
        for s in SPINES {
            let mut batch = Vec::new();
            for h in HOSTS {
                let l = leaf_of(h);
                if !up.contains(&(l, s)) {
                    continue; // the kernel dropped the route with the port
                }
                batch.push(format!("route replace 10.10.{h}.0/24 via 10.2{l}.{s}.1"));
                batch.push(format!("route replace fd00:10:{h}::/64 via fd00:2{l}:{s}::1"));
            }
            self.ip_batch(&format!("s{s}"), &batch)?;
        }
        for h in HOSTS {
            // `::/0`, not `default`: a batch line has no `-6`, the family comes from it.
            self.ip_batch(
                &format!("h{h}"),
                &[
                    format!("route replace default via 10.10.{h}.1"),
                    format!("route replace ::/0 via fd00:10:{h}::1"),
                ],
            )?;
        }
        Ok(())
    }

    /// Runs `ip -batch` in a node: one `ip` command (without the `ip`) per line.
    fn ip_batch(&self, node: &str, cmds: &[String]) -> Result<()> {
        if cmds.is_empty() {
            return Ok(());
        }
        let ns = self.ns(node);
        run_with_input(
            &["ip", "netns", "exec", &ns, "ip", "-batch", "-"],
            &cmds.join("\n"),
        )?;
        Ok(())
    }

    fn ports_up(&self, node: &str) -> Result<std::collections::BTreeSet<String>> {
        let out = self.exec(node, &["ip", "-o", "link", "show"])?;
        Ok(out
            .lines()
            .filter_map(|l| {
                // `2: s1@if5: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu …`
                let mut f = l.split(": ");
                let name = f.nth(1)?.split('@').next()?;
                let flags = f.next()?.split('>').next()?;
                (flags.contains(",UP") || flags.contains("<UP")).then(|| name.to_owned())
            })
            .collect())
    }

    /// Removes every namespace of this lab (their links and rules go with them), after
    /// ending any process still running in one.
    pub fn down(&self) -> Result<()> {
        for ns in self.existing()? {
            for pid in run(&["ip", "netns", "pids", &ns])?.split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    // SAFETY: sending SIGKILL to a process of the lab's own namespace.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            run(&["ip", "netns", "del", &ns])?;
        }
        Ok(())
    }

    /// Per node: interfaces with state and MTU, and active faults.
    pub fn status(&self) -> Result<String> {
        if self.existing()?.is_empty() {
            return Ok(format!("lab `{}` is down\n", self.prefix));
        }
        let mut s = format!(
            "lab `{}` {}\n",
            self.prefix,
            if self.is_up()? { "is up" } else { "is partial" }
        );
        for n in Self::nodes() {
            let Ok(links) = self.exec(&n, &["ip", "-br", "link"]) else {
                continue;
            };
            let ifs: Vec<String> = links
                .lines()
                .filter(|l| !l.starts_with("lo ") && !l.starts_with("mgmt"))
                .map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    format!(
                        "{} {}",
                        f[0].split('@').next().unwrap_or(f[0]),
                        f.get(1).unwrap_or(&"?")
                    )
                })
                .collect();
            let faults = self.active_faults(&n)?;
            s.push_str(&format!(
                "  {n:<3} {}{}\n",
                ifs.join(", "),
                if faults.is_empty() {
                    String::new()
                } else {
                    format!("   faults: {}", faults.join(", "))
                }
            ));
        }
        Ok(s)
    }

    fn active_faults(&self, node: &str) -> Result<Vec<String>> {
        let mut v: Vec<String> = self
            .exec(node, &["nft", "list", "tables"])?
            .lines()
            .filter_map(|l| l.strip_prefix("table inet rtlab_"))
            .map(str::to_owned)
            .collect();
        let q = self.exec(node, &["tc", "qdisc", "show"])?;
        if q.contains("tbf") {
            v.push("bottleneck".into());
        }
        if node.starts_with('l')
            && self
                .exec(node, &["sysctl", "-n", "net.ipv4.fib_multipath_hash_policy"])?
                .trim()
                == "0"
        {
            v.push("ecmp_l3".into());
        }
        Ok(v)
    }

    /// Switches a fault on.
    pub fn apply(&self, f: &Fault) -> Result<()> {
        match f {
            Fault::DscpRewrite { spine, from, to } => self.nft(
                &format!("s{spine}"),
                f.name(),
                // PREROUTING, so the expiring hop's ICMP quote shows the new class.
                "prerouting",
                "filter",
                &[
                    format!("udp dport 4791 ip dscp {from} ip dscp set {to}"),
                    format!("udp dport 4791 ip6 dscp {from} ip6 dscp set {to}"),
                ],
            ),
            Fault::CeMark { node, iface, percent } => {
                let share = if *percent >= 100 {
                    String::new()
                } else {
                    format!("numgen random mod 100 < {percent} ")
                };
                self.nft(
                    node,
                    f.name(),
                    "postrouting",
                    "filter",
                    &[
                        format!("oifname \"{iface}\" udp dport 4791 ip ecn != not-ect {share}ip ecn set ce"),
                        format!(
                            "oifname \"{iface}\" udp dport 4791 ip6 ecn != not-ect {share}ip6 ecn set ce"
                        ),
                    ],
                )
            }
            Fault::Bottleneck { node, iface, rate } => self
                .exec(
                    node,
                    &[
                        "tc", "qdisc", "replace", "dev", iface, "root", "tbf", "rate", rate, "burst", "32kb",
                        "latency", "20ms",
                    ],
                )
                .map(|_| ()),
            Fault::LinkDown { leaf, spine } => {
                self.set_link(*leaf, *spine, false)?;
                self.routes()
            }
            // No routes(): the kernel alone reacts, on the two nodes whose ports went down.
            Fault::LinkDownStatic { leaf, spine } => self.set_link(*leaf, *spine, false),
            Fault::SpineDown { spine } => {
                for l in LEAVES {
                    self.set_link(l, *spine, false)?;
                }
                self.routes()
            }
            Fault::Mtu { leaf, spine, mtu } => self.set_link_mtu(*leaf, *spine, *mtu),
            Fault::EcmpL3 { leaf } => self.hash_policy(*leaf, 0),
            Fault::AsymClass { leaf, from, to } => self.nft(
                &format!("l{leaf}"),
                f.name(),
                "prerouting",
                "filter",
                &[
                    format!("iifname \"h*\" udp dport 4791 ip dscp {from} ip dscp set {to}"),
                    format!("iifname \"h*\" udp dport 4791 ip6 dscp {from} ip6 dscp set {to}"),
                ],
            ),
            // The BTH opcode is the first byte after the UDP header.
            Fault::CnpDrop { leaf } => self.nft(
                &format!("l{leaf}"),
                f.name(),
                "prerouting",
                "filter",
                &["iifname \"s*\" udp dport 4791 @th,64,8 0x81 drop".to_string()],
            ),
        }
    }

    /// Switches a fault off (a fault that is not on is no error).
    pub fn clear(&self, f: &Fault) -> Result<()> {
        match f {
            Fault::DscpRewrite { spine, .. } => self.nft_del(&format!("s{spine}"), f.name()),
            Fault::CeMark { node, .. } => self.nft_del(node, f.name()),
            Fault::AsymClass { leaf, .. } => self.nft_del(&format!("l{leaf}"), f.name()),
            Fault::Bottleneck { node, iface, .. } => {
                let _ = self.exec(node, &["tc", "qdisc", "del", "dev", iface, "root"]);
                Ok(())
            }
            Fault::LinkDown { leaf, spine } | Fault::LinkDownStatic { leaf, spine } => {
                self.set_link(*leaf, *spine, true)?;
                self.routes()
            }
            Fault::SpineDown { spine } => {
                for l in LEAVES {
                    self.set_link(l, *spine, true)?;
                }
                self.routes()
            }
            Fault::Mtu { leaf, spine, .. } => self.set_link_mtu(*leaf, *spine, self.mtu),
            Fault::EcmpL3 { leaf } => self.hash_policy(*leaf, 1),
            Fault::CnpDrop { leaf } => self.nft_del(&format!("l{leaf}"), f.name()),
        }
    }

    /// A leaf's ECMP hash: 0 on addresses (L3), 1 on the 5-tuple (L4), both families.
    fn hash_policy(&self, leaf: u8, policy: u8) -> Result<()> {
        for fam in ["ipv4", "ipv6"] {
            self.exec(
                &format!("l{leaf}"),
                &[
                    "sysctl",
                    "-qw",
                    &format!("net.{fam}.fib_multipath_hash_policy={policy}"),
                ],
            )?;
        }
        Ok(())
    }

    /// Both ends of the link between a leaf and a spine, administratively up or down.
    fn set_link(&self, leaf: u8, spine: u8, up: bool) -> Result<()> {
        let state = if up { "up" } else { "down" };
        self.exec(
            &format!("l{leaf}"),
            &["ip", "link", "set", &format!("s{spine}"), state],
        )?;
        self.exec(
            &format!("s{spine}"),
            &["ip", "link", "set", &format!("l{leaf}"), state],
        )?;
        Ok(())
    }

    /// Both ends of the link between a leaf and a spine at `mtu`.
    fn set_link_mtu(&self, leaf: u8, spine: u8, mtu: u32) -> Result<()> {
        let m = mtu.to_string();
        self.exec(
            &format!("l{leaf}"),
            &["ip", "link", "set", &format!("s{spine}"), "mtu", &m],
        )?;
        self.exec(
            &format!("s{spine}"),
            &["ip", "link", "set", &format!("l{leaf}"), "mtu", &m],
        )?;
        // Below 1280 the kernel takes IPv6 off the link, addresses and routes with it:
        // back at a size IPv6 can use, the link gets them again.
        if mtu >= 1280 {
            for (node, ifname, host) in [
                (format!("l{leaf}"), format!("s{spine}"), 1),
                (format!("s{spine}"), format!("l{leaf}"), 2),
            ] {
                self.exec(
                    &node,
                    &[
                        "ip",
                        "-6",
                        "addr",
                        "replace",
                        &format!("fd00:2{leaf}:{spine}::{host}/64"),
                        "dev",
                        &ifname,
                        "nodad",
                    ],
                )?;
            }
            self.routes()?;
        }
        Ok(())
    }

    fn nft(&self, node: &str, table: &str, hook: &str, kind: &str, rules: &[String]) -> Result<()> {
        self.nft_del(node, table)?;
        let mut script = format!(
            "table inet rtlab_{table} {{\n  chain c {{\n    type {kind} hook {hook} priority mangle; policy accept;\n"
        );
        for r in rules {
            script.push_str(&format!("    {r}\n"));
        }
        script.push_str("  }\n}\n");
        let ns = self.ns(node);
        run_with_input(&["ip", "netns", "exec", &ns, "nft", "-f", "-"], &script)?;
        Ok(())
    }

    fn nft_del(&self, node: &str, table: &str) -> Result<()> {
        let tables = self.exec(node, &["nft", "list", "tables"])?;
        if tables
            .lines()
            .any(|l| l.trim() == format!("table inet rtlab_{table}"))
        {
            self.exec(
                node,
                &["nft", "delete", "table", "inet", &format!("rtlab_{table}")],
            )?;
        }
        Ok(())
    }

    /// The spine a leaf sends a UDP/4791 flow through, as its FIB decides.
    pub fn spine_for(&self, src_host: u8, dst_host: u8, sport: u16, v6: bool) -> Result<u8> {
        let l = leaf_of(src_host);
        let dst = Self::host_ip(dst_host, v6).to_string();
        let src = Self::host_ip(src_host, v6).to_string();
        let sp = sport.to_string();
        let mut args = vec!["ip"];
        if v6 {
            args.push("-6");
        }
        let iif = format!("h{src_host}");
        args.extend([
            "route", "get", &dst, "from", &src, "iif", &iif, "ipproto", "udp", "sport", &sp, "dport", "4791",
        ]);
        let out = self.exec(&format!("l{l}"), &args)?;
        for s in SPINES {
            if out.contains(&format!("dev s{s}")) {
                return Ok(s);
            }
        }
        Err(LabError::Unexpected(format!("no spine in `{}`", out.trim())))
    }
}

/// A fresh lab for one test, torn down at the end even when the test fails.
pub struct LabGuard(pub Lab);

impl LabGuard {
    pub fn up(prefix: &str) -> Self {
        let l = Lab {
            prefix: prefix.into(),
            ..Lab::default()
        };
        l.down().expect("lab down");
        l.up().expect("lab up");
        Self(l)
    }
}

impl Drop for LabGuard {
    fn drop(&mut self) {
        let _ = self.0.down();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lab step's error names the command and what it said; input reaches its stdin.
    #[test]
    fn commands_report_what_failed_and_read_their_input() {
        assert_eq!(run_with_input(&["cat"], "a batch\n").unwrap(), "a batch\n");
        let e = run_with_input(
            &["sh", "-c", "cat >/dev/null; echo no such table >&2; exit 1"],
            "x y",
        )
        .unwrap_err();
        assert!(
            matches!(&e, LabError::Failed { stderr, input, .. } if stderr == "no such table" && input == "x y")
        );
        assert_eq!(
            e.to_string(),
            "sh -c cat >/dev/null; echo no such table >&2; exit 1 failed: no such table\nx y"
        );
        let e = run(&["/nonexistent/ip", "link"]).unwrap_err();
        assert!(matches!(e, LabError::Spawn { .. }), "{e}");
        assert!(e.to_string().starts_with("running /nonexistent/ip link: "), "{e}");
    }
}
