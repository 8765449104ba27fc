//! `trace --paths`: the ECMP map — which source ports take which path.
//!
//! A path is the sequence of transit hops, the routers between source and destination. One
//! probe per hop sees it through rate limits: a router or the destination may stay silent
//! for some ports (Linux rate-limits Port Unreachable by default). Silence says nothing
//! about the path, so a port joins the one path its answers agree with; a port whose
//! answers fit more than one path (silent where they differ) is unresolved, never a path
//! of its own.

use std::net::IpAddr;

use serde::Serialize;

use super::{TraceError, TraceOptions, TraceReport, trace};

/// ECMP map: which source ports take which path.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PathsReport {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Each distinct path and the ports on it, in the order they were found.
    pub paths: Vec<PathPorts>,
    /// Ports whose answers fit more than one path.
    pub unresolved: Vec<UnresolvedPort>,
    pub ports_tried: u32,
    /// Stopped after this many ports in a row showed no new path.
    pub patience: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PathPorts {
    /// The path's number (1, 2, …), as `could_be` and the human output name it.
    pub path: u32,
    /// The transit hops (`null`: silent for every port of the path), then the destination
    /// if it answered for any of them.
    pub hops: Vec<Option<IpAddr>>,
    pub udp_sports: Vec<u16>,
    /// Ports on this path (the length of `udp_sports`).
    pub ports: u32,
    /// Of those, the ports for which the destination answered; it was silent for the
    /// others (a rate-limited ICMP, or a RoCE NIC that drops probes).
    pub destination_answered: u32,
    /// Of those, the ports for which one of the path's transit hops was silent.
    pub silent_hop: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct UnresolvedPort {
    pub udp_sport: u16,
    /// What answered, by TTL (`null`: silent), then the destination if it answered.
    pub hops: Vec<Option<IpAddr>>,
    /// The paths (their numbers) its answers fit.
    pub could_be: Vec<u32>,
}

/// Varies the source port from `opts.sport` until `patience` ports in a row reveal no new
/// path, or `max_ports` were tried.
pub fn paths(opts: &TraceOptions, patience: u32, max_ports: u32) -> Result<PathsReport, TraceError> {
    paths_with(opts, patience, max_ports, trace)
}

fn paths_with(
    opts: &TraceOptions,
    patience: u32,
    max_ports: u32,
    mut trace_port: impl FnMut(&TraceOptions) -> Result<TraceReport, TraceError>,
) -> Result<PathsReport, TraceError> {
    let mut seen = Vec::new();
    let (mut most, mut since_new, mut tried) = (0, 0, 0);
    while since_new < patience && tried < max_ports {
        let sport = opts
            .sport
            .checked_add(tried as u16)
            .ok_or_else(|| TraceError::Invalid("source ports exhausted".into()))?;
        let r = trace_port(&TraceOptions {
            sport,
            probes: 1,
            ..opts.clone()
        })?;
        tried += 1;
        seen.push(Sighting::of(&r));
        // A later port can place an earlier one (it saw the hops that one missed): the
        // map is redone from every port, and only more paths than ever is news.
        let n = group(&seen).paths.len();
        if n > most {
            most = n;
            since_new = 0;
        } else {
            since_new += 1;
        }
    }
    Ok(report(opts, &seen, tried, patience))
}

/// What one port's trace says about its path.
#[derive(Clone, Debug)]
struct Sighting {
    sport: u16,
    /// The transit hops by TTL, up to the last router that answered (`None`: silent).
    transit: Vec<Option<IpAddr>>,
    /// The most transit hops the path can have: the destination, or a router refusing the
    /// probe, answered at the next TTL or this one. `None`: the trace ended in silence, and
    /// the path may go on past what answered.
    max_len: Option<usize>,
    destination_answered: bool,
}

impl Sighting {
    fn of(r: &TraceReport) -> Self {
        let last = r.hops.last();
        let destination_answered = last.is_some_and(|h| h.addr == Some(r.dst));
        let refused = last
            .is_some_and(|h| h.addr.is_some() && h.answer.as_deref().is_some_and(|a| a != "time-exceeded"));
        let before_dst = r.hops.len() - usize::from(destination_answered);
        let answered_to = r.hops[..before_dst]
            .iter()
            .rposition(|h| h.addr.is_some())
            .map_or(0, |i| i + 1);
        Sighting {
            sport: r.udp_sport,
            transit: r.hops[..answered_to].iter().map(|h| h.addr).collect(),
            max_len: refused.then_some(before_dst),
            destination_answered,
        }
    }

    fn silent_hops(&self) -> usize {
        self.transit.iter().filter(|h| h.is_none()).count()
    }

    /// Every transit hop answered and the path ends where the answers do.
    fn is_whole(&self) -> bool {
        self.silent_hops() == 0 && self.max_len == Some(self.transit.len())
    }

    /// Could this port have taken `p`: a length both allow, and no hop where both answered
    /// with different routers.
    fn fits(&self, p: &Group) -> bool {
        let shortest = self.transit.len().max(p.hops.len());
        let longest = self
            .max_len
            .unwrap_or(usize::MAX)
            .min(p.max_len.unwrap_or(usize::MAX));
        shortest <= longest
            && self
                .transit
                .iter()
                .zip(&p.hops)
                .all(|(a, b)| a.is_none() || b.is_none() || a == b)
    }
}

/// A path while the map is made: what the port that defines it saw, and its ports
/// (indices into the sightings).
#[derive(Debug)]
struct Group {
    hops: Vec<Option<IpAddr>>,
    max_len: Option<usize>,
    members: Vec<usize>,
}

impl Group {
    fn of(s: &Sighting) -> Self {
        Group {
            hops: s.transit.clone(),
            max_len: s.max_len,
            members: Vec::new(),
        }
    }
}

struct Grouping {
    /// In the order of their first port.
    paths: Vec<Group>,
    /// A port, and the paths (indices into `paths`) it fits.
    unresolved: Vec<(usize, Vec<usize>)>,
}

/// The map: ports that saw a path whole define it; every other port joins the one path its
/// answers fit, or is unresolved when they fit several. A port that fits no path shows one
/// no port saw whole (a router that never answers, a destination that never does).
fn group(seen: &[Sighting]) -> Grouping {
    let mut paths: Vec<Group> = Vec::new();
    let mut partial = Vec::new();
    for (i, s) in seen.iter().enumerate() {
        if !s.is_whole() {
            partial.push(i);
        } else if let Some(g) = paths.iter_mut().find(|g| g.hops == s.transit) {
            g.members.push(i);
        } else {
            paths.push(Group::of(s));
            paths.last_mut().expect("just pushed").members.push(i);
        }
    }
    let whole = paths.len();
    let mut founders: Vec<usize> = partial
        .iter()
        .copied()
        .filter(|&i| !paths.iter().any(|g| seen[i].fits(g)))
        .collect();
    // The fewest silent hops first: they give the clearest picture of such a path. A
    // founder fits its own path only (`fits` is symmetric between two ports' paths).
    founders.sort_by_key(|&i| (seen[i].silent_hops(), i));
    for i in founders {
        if !paths[whole..].iter().any(|g| seen[i].fits(g)) {
            paths.push(Group::of(&seen[i]));
        }
    }
    let mut unresolved = Vec::new();
    for i in partial {
        let fit: Vec<usize> = (0..paths.len()).filter(|&p| seen[i].fits(&paths[p])).collect();
        match fit[..] {
            [p] => paths[p].members.push(i),
            _ => unresolved.push((i, fit)),
        }
    }
    for g in &mut paths {
        g.members.sort_unstable();
    }
    let mut order: Vec<usize> = (0..paths.len()).collect();
    order.sort_by_key(|&p| paths[p].members.first().copied().unwrap_or(usize::MAX));
    let mut number = vec![0; paths.len()];
    for (n, &p) in order.iter().enumerate() {
        number[p] = n;
    }
    for (_, fit) in &mut unresolved {
        for p in fit.iter_mut() {
            *p = number[*p];
        }
        fit.sort_unstable();
    }
    let mut slots: Vec<Option<Group>> = paths.into_iter().map(Some).collect();
    Grouping {
        paths: order
            .iter()
            .map(|&p| slots[p].take().expect("each path once"))
            .collect(),
        unresolved,
    }
}

/// What the members of a path saw at each TTL: the router where those that answered agree.
fn hops_seen(g: &Group, seen: &[Sighting]) -> Vec<Option<IpAddr>> {
    let len = g
        .members
        .iter()
        .map(|&i| seen[i].transit.len())
        .chain([g.hops.len()])
        .max()
        .unwrap_or(0);
    (0..len)
        .map(|t| {
            let mut answers = g
                .members
                .iter()
                .filter_map(|&i| seen[i].transit.get(t).copied().flatten())
                .chain(g.hops.get(t).copied().flatten());
            let first = answers.next()?;
            answers.all(|a| a == first).then_some(first)
        })
        .collect()
}

fn report(opts: &TraceOptions, seen: &[Sighting], tried: u32, patience: u32) -> PathsReport {
    let g = group(seen);
    let with_dst = |mut hops: Vec<Option<IpAddr>>, answered: bool| {
        if answered {
            hops.push(Some(opts.dst));
        }
        hops
    };
    let paths = g
        .paths
        .iter()
        .enumerate()
        .map(|(n, p)| {
            let transit = hops_seen(p, seen);
            let members = p.members.iter().map(|&i| &seen[i]);
            let count = |f: &dyn Fn(&Sighting) -> bool| members.clone().filter(|s| f(s)).count() as u32;
            PathPorts {
                path: n as u32 + 1,
                udp_sports: members.clone().map(|s| s.sport).collect(),
                ports: p.members.len() as u32,
                destination_answered: count(&|s| s.destination_answered),
                silent_hop: count(&|s| s.silent_hops() > 0 || s.transit.len() < transit.len()),
                hops: with_dst(transit, members.clone().any(|s| s.destination_answered)),
            }
        })
        .collect();
    let unresolved = g
        .unresolved
        .iter()
        .map(|(i, fit)| UnresolvedPort {
            udp_sport: seen[*i].sport,
            hops: with_dst(seen[*i].transit.clone(), seen[*i].destination_answered),
            could_be: fit.iter().map(|&p| p as u32 + 1).collect(),
        })
        .collect();
    PathsReport {
        kind: "paths",
        src: opts.src,
        dst: opts.dst,
        paths,
        unresolved,
        ports_tried: tried,
        patience,
    }
}

pub fn render_paths(r: &PathsReport) -> String {
    let hops = |h: &[Option<IpAddr>]| {
        h.iter()
            .map(|h| h.map(|a| a.to_string()).unwrap_or_else(|| "*".into()))
            .collect::<Vec<_>>()
            .join(" -> ")
    };
    let mut s = format!(
        "{} distinct paths {} -> {} ({} source ports tried, stopped after {} in a row showed nothing new)\n",
        r.paths.len(),
        r.src,
        r.dst,
        r.ports_tried,
        r.patience
    );
    for p in &r.paths {
        s.push_str(&format!(
            "path {}: {}\n  {} ports: the destination answered for {}, {} had a silent hop\n  source ports: {:?}\n",
            p.path,
            hops(&p.hops),
            p.ports,
            p.destination_answered,
            p.silent_hop,
            p.udp_sports
        ));
    }
    if !r.unresolved.is_empty() {
        s.push_str(&format!(
            "{} ports unresolved (silent where the paths differ):\n",
            r.unresolved.len()
        ));
        for u in &r.unresolved {
            let could_be: Vec<String> = u.could_be.iter().map(|p| p.to_string()).collect();
            s.push_str(&format!(
                "  {}: {}   could be path {}\n",
                u.udp_sport,
                hops(&u.hops),
                could_be.join(" or ")
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, time::Duration};

    use super::*;
    use crate::trace::{Answer, trace_with};

    /// ICMP as a Linux host or router limits it (`net.ipv4.icmp_ratelimit`): a token every
    /// `every_ms`, a burst of 6 at most.
    #[derive(Clone, Copy)]
    enum Limit {
        Always,
        Never,
        Bucket {
            every_ms: u64,
            tokens_ms: u64,
            last_ms: u64,
        },
    }

    impl Limit {
        fn linux_default() -> Self {
            Limit::Bucket {
                every_ms: 1000,
                tokens_ms: 6000,
                last_ms: 0,
            }
        }

        fn allows(&mut self, now_ms: u64) -> bool {
            match self {
                Limit::Always => true,
                Limit::Never => false,
                Limit::Bucket {
                    every_ms,
                    tokens_ms,
                    last_ms,
                } => {
                    *tokens_ms = (*tokens_ms + (now_ms - *last_ms)).min(6 * *every_ms);
                    *last_ms = now_ms;
                    let ok = *tokens_ms >= *every_ms;
                    if ok {
                        *tokens_ms -= *every_ms;
                    }
                    ok
                }
            }
        }
    }

    /// A fabric seen through probes, in simulated time: ECMP puts each source port on one
    /// of `routes`; each router answers Time Exceeded and the destination Port Unreachable
    /// when their ICMP limits let them. What each port met is kept to check the map against.
    struct Fabric {
        dst: IpAddr,
        routes: Vec<Vec<IpAddr>>,
        routers: BTreeMap<IpAddr, Limit>,
        destination: Limit,
        now_ms: u64,
        /// Per port: the destination answered it; one of its routers was silent.
        met: BTreeMap<u16, (bool, bool)>,
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ips(a: &[&str]) -> Vec<IpAddr> {
        a.iter().map(|s| ip(s)).collect()
    }

    impl Fabric {
        fn new(routes: &[&[&str]]) -> Self {
            Fabric {
                dst: ip("10.10.4.2"),
                routes: routes.iter().map(|r| ips(r)).collect(),
                routers: BTreeMap::new(),
                destination: Limit::Always,
                now_ms: 0,
                met: BTreeMap::new(),
            }
        }

        /// The ECMP hash.
        fn route(&self, sport: u16) -> usize {
            ((sport as u32).wrapping_mul(0x9e37_79b1) >> 16) as usize % self.routes.len()
        }

        fn probe(&mut self, o: &TraceOptions, ttl: u8, psn: u32) -> Option<(Answer, Duration)> {
            // At --rate 100; a probe nobody answers costs the whole timeout.
            self.now_ms += 10;
            let route = &self.routes[self.route(o.sport)];
            let met = self.met.entry(o.sport).or_default();
            let (from, kind) = match route.get(ttl as usize - 1) {
                Some(&router) => {
                    let limit = self.routers.entry(router).or_insert(Limit::Always);
                    if !limit.allows(self.now_ms) {
                        met.1 = true;
                        self.now_ms += o.timeout.as_millis() as u64;
                        return None;
                    }
                    (router, "time-exceeded")
                }
                None => {
                    if !self.destination.allows(self.now_ms) {
                        self.now_ms += o.timeout.as_millis() as u64;
                        return None;
                    }
                    met.0 = true;
                    (self.dst, "port-unreachable")
                }
            };
            let answer = Answer {
                from,
                kind: kind.into(),
                final_hop: kind != "time-exceeded",
                tos: (o.dscp << 2) | o.ecn,
                psn,
            };
            Some((answer, Duration::from_micros(80)))
        }

        /// `trace --paths` from 10.10.2.2, source ports from 49152, `--timeout 300ms`.
        fn map(&mut self, patience: u32) -> PathsReport {
            let opts = TraceOptions {
                dst: self.dst,
                src: ip("10.10.2.2"),
                sport: 49152,
                dscp: 26,
                ecn: 2,
                max_hops: 16,
                probes: 1,
                timeout: Duration::from_millis(300),
                rate: 100,
            };
            paths_with(&opts, patience, 256, |o| {
                trace_with(o, |ttl, psn| Ok(self.probe(o, ttl, psn)))
            })
            .unwrap()
        }

        /// The ports of each route as the fabric sent them, in the order the map found them.
        fn ports_per_route(&self, r: &PathsReport) -> Vec<Vec<u16>> {
            let mut order = Vec::new();
            let mut ports: BTreeMap<usize, Vec<u16>> = BTreeMap::new();
            for &sport in self.met.keys() {
                let route = self.route(sport);
                if !order.contains(&route) {
                    order.push(route);
                }
                ports.entry(route).or_default().push(sport);
            }
            assert_eq!(self.met.len() as u32, r.ports_tried);
            order.iter().map(|k| ports[k].clone()).collect()
        }

        fn answered(&self, ports: &[u16]) -> u32 {
            ports.iter().filter(|p| self.met[p].0).count() as u32
        }

        fn silent_router(&self, ports: &[u16]) -> Vec<u16> {
            ports.iter().copied().filter(|p| self.met[p].1).collect()
        }
    }

    const SPINE_1: &[&str] = &["10.10.2.1", "10.21.1.2", "10.22.1.1"];
    const SPINE_2: &[&str] = &["10.10.2.1", "10.21.2.2", "10.22.2.1"];

    fn with_dst(route: &[&str], dst: &str) -> Vec<Option<IpAddr>> {
        route.iter().chain([&dst]).map(|s| Some(ip(s))).collect()
    }

    /// The reported bug: a Linux destination rate-limits Port Unreachable, so on both
    /// spines some ports hear nothing from it — those ports were counted as two more paths.
    #[test]
    fn a_rate_limited_destination_adds_no_paths() {
        let mut f = Fabric::new(&[SPINE_1, SPINE_2]);
        f.destination = Limit::linux_default();
        let r = f.map(12);
        let truth = f.ports_per_route(&r);
        assert_eq!(r.paths.len(), 2, "{}", render_paths(&r));
        for (p, ports) in r.paths.iter().zip(&truth) {
            assert_eq!(p.udp_sports, *ports, "{}", render_paths(&r));
            assert_eq!(p.ports, ports.len() as u32);
            let answered = f.answered(ports);
            assert_eq!(p.destination_answered, answered);
            assert!(
                0 < answered && answered < p.ports,
                "the destination was silent for some ports of path {}, not all: {}",
                p.path,
                render_paths(&r)
            );
            assert_eq!(p.silent_hop, 0);
        }
        assert_eq!(r.paths[0].hops, with_dst(SPINE_1, "10.10.4.2"));
        assert_eq!(r.paths[1].hops, with_dst(SPINE_2, "10.10.4.2"));
        assert!(r.unresolved.is_empty());
        // Nothing new after the first port of path 2: the patience runs out right after it.
        assert_eq!(r.ports_tried, u32::from(truth[1][0] - 49152) + 1 + 12);
    }

    /// Spine 1 rate-limits its Time Exceeded: some ports through it show `*` at hop 2.
    /// The next hop (the leaf's address toward that spine) still places them.
    #[test]
    fn a_silent_spine_on_some_ports_is_still_its_path() {
        let mut f = Fabric::new(&[SPINE_1, SPINE_2]);
        f.routers.insert(ip("10.21.1.2"), Limit::linux_default());
        let r = f.map(16);
        let truth = f.ports_per_route(&r);
        assert_eq!(r.paths.len(), 2, "{}", render_paths(&r));
        for (p, ports) in r.paths.iter().zip(&truth) {
            assert_eq!(p.udp_sports, *ports, "{}", render_paths(&r));
            assert_eq!(p.destination_answered, p.ports);
            assert_eq!(p.silent_hop, f.silent_router(ports).len() as u32);
        }
        assert!(r.paths[0].silent_hop > 0, "{}", render_paths(&r));
        assert_eq!(r.paths[0].hops, with_dst(SPINE_1, "10.10.4.2"));
        assert!(r.unresolved.is_empty());
    }

    /// The leaf answers from one address whichever spine the probe came through: a port
    /// whose spine was silent could be on either path. It is neither a third path nor
    /// guessed onto one.
    #[test]
    fn a_silent_hop_where_the_paths_differ_is_unresolved() {
        let mut f = Fabric::new(&[
            &["10.10.2.1", "10.21.1.2", "10.0.0.12"],
            &["10.10.2.1", "10.21.2.2", "10.0.0.12"],
        ]);
        for spine in ["10.21.1.2", "10.21.2.2"] {
            f.routers.insert(ip(spine), Limit::linux_default());
        }
        let r = f.map(16);
        let truth = f.ports_per_route(&r);
        assert_eq!(r.paths.len(), 2, "{}", render_paths(&r));
        let mut unresolved = Vec::new();
        for (p, ports) in r.paths.iter().zip(&truth) {
            let silent = f.silent_router(ports);
            let placed: Vec<u16> = ports.iter().copied().filter(|p| !silent.contains(p)).collect();
            assert_eq!(p.udp_sports, placed, "{}", render_paths(&r));
            assert_eq!(p.silent_hop, 0);
            unresolved.extend(silent);
        }
        unresolved.sort_unstable();
        assert!(!unresolved.is_empty(), "some spine answers were limited");
        let got: Vec<u16> = r.unresolved.iter().map(|u| u.udp_sport).collect();
        assert_eq!(got, unresolved, "{}", render_paths(&r));
        for u in &r.unresolved {
            assert_eq!(u.could_be, [1, 2]);
            assert_eq!(
                u.hops,
                [Some(ip("10.10.2.1")), None, Some(ip("10.0.0.12")), Some(f.dst)]
            );
        }
    }

    /// Four spines are four paths, even with the destination's answers limited: merging
    /// ports must not merge paths that differ.
    #[test]
    fn four_real_paths_stay_four() {
        let mut f = Fabric::new(&[
            SPINE_1,
            SPINE_2,
            &["10.10.2.1", "10.21.3.2", "10.22.3.1"],
            &["10.10.2.1", "10.21.4.2", "10.22.4.1"],
        ]);
        f.destination = Limit::linux_default();
        let r = f.map(12);
        let truth = f.ports_per_route(&r);
        assert_eq!(r.paths.len(), 4, "{}", render_paths(&r));
        for (p, ports) in r.paths.iter().zip(&truth) {
            assert_eq!(p.udp_sports, *ports, "{}", render_paths(&r));
            assert_eq!(p.destination_answered, f.answered(ports));
            assert_eq!(p.hops[1], Some(f.routes[f.route(ports[0])][1]));
        }
        assert!(r.unresolved.is_empty());
    }

    /// A RoCE NIC drops probes without a word: every path ends in silence, and each is
    /// still a path of its own.
    #[test]
    fn a_destination_that_never_answers_still_shows_each_path() {
        let mut f = Fabric::new(&[SPINE_1, SPINE_2]);
        f.destination = Limit::Never;
        let r = f.map(8);
        let truth = f.ports_per_route(&r);
        assert_eq!(r.paths.len(), 2, "{}", render_paths(&r));
        for (p, ports) in r.paths.iter().zip(&truth) {
            assert_eq!(p.udp_sports, *ports);
            assert_eq!((p.destination_answered, p.silent_hop), (0, 0));
        }
        let spine_1: Vec<Option<IpAddr>> = SPINE_1.iter().map(|s| Some(ip(s))).collect();
        assert_eq!(r.paths[0].hops, spine_1);
        assert!(r.unresolved.is_empty());
    }

    #[test]
    fn ports_with_identical_hops_are_one_path() {
        let mut f = Fabric::new(&[SPINE_1]);
        let r = f.map(8);
        assert_eq!(r.paths.len(), 1, "{}", render_paths(&r));
        let p = &r.paths[0];
        assert_eq!(p.udp_sports, (49152..49152 + 9).collect::<Vec<u16>>());
        assert_eq!((p.ports, p.destination_answered, p.silent_hop), (9, 9, 0));
        assert_eq!(p.hops, with_dst(SPINE_1, "10.10.4.2"));
        assert_eq!(r.ports_tried, 1 + 8);
    }
}
