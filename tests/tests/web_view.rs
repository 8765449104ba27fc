//! The pictures in a real browser: headless Chromium, driven over WebDriver
//! (chromedriver), against a lab collector whose spine s1 rewrites RDMA's DSCP, and
//! against the `verify --html` report of the same fabric. The map must show every node
//! of the lab in its tier and mark s1 and nothing else; clicking s1 lists affected
//! flows; an affected flow's page draws the change between s1's two points; no console
//! errors. Screenshots are saved (`docs/images/`, what the README shows).

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use roce_trace_tests::{
    lab::{Fault, Lab, LabGuard, Observers},
    *,
};
use serde_json::{Value, json};

const TOKEN: &str = "web-view-token";
const HTTP: &str = "127.0.0.1:8080";
const DRIVER: &str = "127.0.0.1:9515";

/// One HTTP/1.1 request to chromedriver (which answers `Connection: close`d requests
/// whole): the JSON it answered.
fn call(method: &str, path: &str, body: Option<&Value>) -> Value {
    let mut s = TcpStream::connect(DRIVER).expect("chromedriver");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {DRIVER}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // chromedriver answers with a length (never chunked) and may keep the connection
    // open: read the head, then that many bytes.
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    let (head, body) = loop {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "chromedriver closed the connection: {}",
            String::from_utf8_lossy(&raw)
        );
        raw.extend_from_slice(&buf[..n]);
        if let Some(i) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..i]).into_owned();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("a Content-Length");
            while raw.len() < i + 4 + len {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "chromedriver closed the connection mid-answer");
                raw.extend_from_slice(&buf[..n]);
            }
            break (
                head,
                String::from_utf8_lossy(&raw[i + 4..i + 4 + len]).into_owned(),
            );
        }
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{head}\n{body}: {e}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{method} {path}: {head}\n{v:#}");
    v["value"].clone()
}

struct Browser {
    session: String,
}

impl Browser {
    fn start() -> Self {
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1500,1150", "--force-device-scale-factor=1"],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let v = call("POST", "/session", Some(&caps));
        Self {
            session: v["sessionId"].as_str().expect("a session").to_string(),
        }
    }

    fn go(&self, url: &str) {
        call(
            "POST",
            &format!("/session/{}/url", self.session),
            Some(&json!({ "url": url })),
        );
    }

    /// Runs `script` (a function body) in the page: what it returned.
    fn js(&self, script: &str) -> Value {
        call(
            "POST",
            &format!("/session/{}/execute/sync", self.session),
            Some(&json!({ "script": script, "args": [] })),
        )
    }

    /// Waits until `script` returns true.
    fn wait_for(&self, what: &str, script: &str) {
        let t = Instant::now();
        while self.js(script) != json!(true) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the page never showed {what}: {}",
                self.js("return document.body.innerHTML.slice(0, 4000)")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn click(&self, css: &str) {
        let el = call(
            "POST",
            &format!("/session/{}/element", self.session),
            Some(&json!({ "using": "css selector", "value": css })),
        );
        let id = el
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .expect("an element")
            .to_string();
        call(
            "POST",
            &format!("/session/{}/element/{id}/click", self.session),
            Some(&json!({})),
        );
    }

    /// Console messages at SEVERE level (errors, uncaught exceptions, failed loads).
    fn console_errors(&self) -> Vec<String> {
        let v = call(
            "POST",
            &format!("/session/{}/se/log", self.session),
            Some(&json!({ "type": "browser" })),
        );
        v.as_array()
            .unwrap()
            .iter()
            .filter(|m| m["level"] == "SEVERE")
            .map(|m| m["message"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn screenshot(&self, to: &Path) {
        let v = call("GET", &format!("/session/{}/screenshot", self.session), None);
        let png = base64(v.as_str().expect("base64 PNG"));
        assert_eq!(&png[1..4], b"PNG");
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = std::panic::catch_unwind(|| call("DELETE", &format!("/session/{}", self.session), None));
    }
}

fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let b: Vec<u8> = s
        .bytes()
        .filter(|&c| c != b'=' && !c.is_ascii_whitespace())
        .collect();
    let mut out = Vec::with_capacity(b.len() * 3 / 4);
    for chunk in b.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= u32::from(val(c)) << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// Every metric a dashboard panel queries is one the binaries export, and every label a
/// query groups or filters by is one those metrics' series carry
/// ([`roce_trace_tests::promql::check_exprs`]). What is wrong, or Ok.
fn check_queries(dashboard: &Value, names: &BTreeMap<String, BTreeSet<String>>) -> Result<usize, String> {
    let mut exprs = Vec::new();
    for p in dashboard["panels"].as_array().ok_or("no panels")? {
        for t in p["targets"].as_array().ok_or("a panel without targets")? {
            exprs.push(t["expr"].as_str().ok_or("a target without expr")?.to_string());
        }
    }
    promql::check_exprs(&exprs, names)
}

fn images() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/images")
}

/// chromedriver in the management namespace (where the collector listens), stopped on
/// drop.
fn chromedriver(lab: &Lab) -> Proc {
    let missing = ["chromium", "chromedriver"]
        .into_iter()
        .filter(|b| !Path::new(&format!("/usr/bin/{b}")).exists())
        .collect::<Vec<_>>();
    assert!(
        missing.is_empty(),
        "{missing:?} missing: scripts/setup installs Debian's chromium and chromium-driver"
    );
    let p = Proc::spawn(
        std::process::Command::new("ip")
            .args(["netns", "exec", &lab.ns("mgmt"), "chromedriver", "--port=9515"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    );
    let t = Instant::now();
    while in_netns(&lab.ns("mgmt"), || TcpStream::connect(DRIVER).is_err()) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "chromedriver did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    p
}

#[test]
fn the_map_and_the_report_show_a_dscp_rewrite_at_its_spine_in_a_browser() {
    if !require_root() {
        return;
    }
    let lab = LabGuard::up("rtwv");
    let dir = TempDir::new("web-view");
    // The collector judges the shipped policy continuously too: its checks above the map.
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/fabric-policy.toml");
    let history = dir.path("verdicts.jsonl");
    let obs = Observers::start_with(
        &lab.0,
        dir.path("report.json"),
        TOKEN,
        &[
            "--http",
            HTTP,
            "--policy",
            policy.to_str().unwrap(),
            "--verify-every",
            "1s",
            "--verify-window",
            "2s",
            "--fail-after",
            "1",
            "--verdict-history",
            history.to_str().unwrap(),
        ],
        |_| vec!["--metrics".into(), "127.0.0.1:9464".into()],
    );
    lab.0
        .apply(&Fault::DscpRewrite {
            spine: 1,
            from: 26,
            to: 0,
        })
        .unwrap();
    let gens = lab::two_pairs_traffic(&lab.0, 20);
    // The collector has seen the rewrite, and traffic on every host, before we look.
    let mgmt = lab.0.ns("mgmt");
    let t = Instant::now();
    loop {
        let r: Value = in_netns(&mgmt, || {
            let (status, body) =
                roce_trace::http::get(HTTP.parse().unwrap(), "/report", Duration::from_secs(10)).unwrap();
            assert_eq!(status, 200);
            serde_json::from_slice(&body).unwrap()
        });
        let changes = r["anomalies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["kind"] == "class_change")
            .count();
        let hosts = ["h1", "h2", "h3", "h4"]
            .iter()
            .filter(|h| {
                r["flows"].as_array().unwrap().iter().any(|f| {
                    f["path"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|p| p.as_str().unwrap().starts_with(&format!("{h}:")))
                })
            })
            .count();
        if changes > 0 && hosts == 4 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no class change on all hosts' paths yet: {changes}, {hosts}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // The report of the same fabric: verify, in the management namespace, judges a window
    // of the running traffic while the browser looks at the map.
    let out = dir.path("verdict.html");
    let verify = std::process::Command::new("ip")
        .args(["netns", "exec", &mgmt])
        .arg(roce_trace_bin())
        .args(["verify", "--policy"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/fabric-policy.toml"))
        .args(["--collector-http", HTTP, "--window", "5s", "--html"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let _driver = chromedriver(&lab.0);
    let shots = images();
    in_netns(&mgmt, move || {
        let b = Browser::start();
        b.go(&format!("http://{HTTP}/"));
        b.wait_for(
            "the map",
            "return document.querySelectorAll('#map .node').length >= 8",
        );
        // Every node of the lab, in its tier: hosts 0, leaves 1, spines 2.
        let nodes = b.js(
            "return [...document.querySelectorAll('#map .node')].map(n => [n.dataset.node, n.dataset.tier, n.dataset.marks])",
        );
        let nodes: Vec<(String, String, String)> = serde_json::from_value(nodes).unwrap();
        let tier = |n: &str| nodes.iter().find(|x| x.0 == n).map(|x| x.1.clone());
        for (n, t) in [
            ("h1", "0"),
            ("h2", "0"),
            ("h3", "0"),
            ("h4", "0"),
            ("l1", "1"),
            ("l2", "1"),
            ("s1", "2"),
            ("s2", "2"),
        ] {
            assert_eq!(tier(n).as_deref(), Some(t), "{n}: {nodes:?}");
        }
        // s1 is marked for the class change; no other node or link is.
        let marked: Vec<String> = serde_json::from_value(b.js(
            "return [...document.querySelectorAll('#map .node, #map .link')].filter(e => (e.dataset.marks || '').split(' ').includes('class_change')).map(e => e.dataset.node || (e.dataset.a + '-' + e.dataset.b))",
        ))
        .unwrap();
        assert_eq!(marked, vec!["s1".to_string()], "{nodes:?}");
        // Its colour is the class-change colour, in the page as drawn.
        let fill =
            b.js("return getComputedStyle(document.querySelector('#map .node[data-node=\"s1\"] rect')).fill");
        assert_eq!(fill, json!("rgb(194, 24, 91)"));
        // Above the map, the checks judged continuously: data_class failing (s1 rewrites
        // from the start), the CE budget not (nothing CE-marks here).
        b.wait_for(
            "data_class failing in the continuous checks",
            "return document.querySelector('#verdicts tr[data-check=\"data_class\"]')?.dataset.status === 'fail'",
        );
        let ce =
            b.js("return document.querySelector('#verdicts tr[data-check=\"ce_fraction\"]')?.dataset.status");
        assert_eq!(ce, json!("pass"));
        b.screenshot(&shots.join("web-map.png"));
        // Click s1: its flows are listed; follow the first to its page.
        b.click("#map .node[data-node=\"s1\"]");
        b.wait_for("s1's flows", "return !document.querySelector('#panel').hidden && document.querySelectorAll('#panel a').length > 0");
        let first: String =
            serde_json::from_value(b.js("return document.querySelector('#panel a').textContent")).unwrap();
        // Each listed flow says what was located on it at s1.
        let states: Vec<String> = serde_json::from_value(
            b.js("return [...document.querySelectorAll('#panel li .state')].map(s => s.dataset.marks)"),
        )
        .unwrap();
        assert!(
            !states.is_empty() && states.iter().all(|m| m == "class_change"),
            "{states:?}"
        );
        // Every flow through s1 is rewritten (data and ACKs alike are DSCP 26; there is no
        // CE marking, so no CNP in another class): the first listed must show it.
        b.click("#panel a");
        b.wait_for(
            "the flow page",
            "return !!document.querySelector('#flow .flow-path')",
        );
        let url: String = serde_json::from_value(b.js("return location.hash")).unwrap();
        assert!(url.starts_with("#flow="), "{url}");
        let hops: Vec<(String, String, String)> = serde_json::from_value(b.js(
            "return [...document.querySelectorAll('#flow .hop')].map(h => [h.dataset.from, h.dataset.to, h.dataset.marks])",
        ))
        .unwrap();
        let changed: Vec<&(String, String, String)> =
            hops.iter().filter(|h| h.2.contains("class_change")).collect();
        assert_eq!(changed.len(), 1, "{first}: {hops:?}");
        let (from, to) = (&changed[0].0, &changed[0].1);
        assert!(
            from.starts_with("s1:")
                && from.ends_with(":ingress")
                && to.starts_with("s1:")
                && to.ends_with(":egress"),
            "{first}: the change drawn between {from} and {to}"
        );
        let dscp: Vec<(String, String)> = serde_json::from_value(b.js(
            "return [...document.querySelectorAll('#flow .point')].map(p => [p.dataset.point, p.dataset.dscp])",
        ))
        .unwrap();
        let at = |p: &str| dscp.iter().find(|x| x.0 == p).map(|x| x.1.clone());
        assert_eq!(at(from).as_deref(), Some("26"), "{dscp:?}");
        assert_eq!(at(to).as_deref(), Some("0"), "{dscp:?}");
        b.screenshot(&shots.join("web-flow.png"));
        // A shared link opens the same flow page in a fresh load.
        b.go(&format!("http://{HTTP}/{url}"));
        b.wait_for(
            "the shared flow",
            "return !!document.querySelector('#flow .flow-path')",
        );
        let errors = b.console_errors();
        assert!(errors.is_empty(), "console errors: {errors:?}");
    });
    // The Grafana dashboard queries what the agents and the collector export.
    let scrape = |node: &str, addr: &str| {
        let addr = addr.to_string();
        let (status, body) = in_netns(&lab.0.ns(node), move || {
            roce_trace::http::get(addr.parse().unwrap(), "/metrics", Duration::from_secs(10)).unwrap()
        });
        assert_eq!(status, 200);
        String::from_utf8(body).unwrap()
    };
    let mut names = promql::exported(
        &(scrape("h1", "127.0.0.1:9464") + &scrape("l1", "127.0.0.1:9464") + &scrape("mgmt", HTTP)),
    );
    // NIC counters appear once a port reports them (no NIC here): their names come from
    // the vocabulary the agent renders them by, with the labels it gives them.
    for spec in roce_trace_common::nic::SPECS {
        names
            .entry(format!("roce_trace_{}", spec.metric))
            .or_default()
            .extend(["interface", "device", "port", "priority", "direction"].map(String::from));
    }
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/grafana-dashboard.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let n = check_queries(&dashboard, &names).unwrap_or_else(|e| panic!("dist/grafana-dashboard.json: {e}"));
    assert!(n >= 12, "{n} queries");
    // The check catches a wrong name and a wrong label.
    for (from, to) in [
        ("roce_trace_cnp_total", "roce_trace_cnps_total"),
        ("by (kind)", "by (nak_kind)"),
    ] {
        let bad: Value = serde_json::from_str(&dashboard.to_string().replacen(from, to, 1)).unwrap();
        assert!(check_queries(&bad, &names).is_err(), "{from} → {to} passed");
    }
    for g in gens {
        let _ = g.wait_with_output();
    }
    let v = verify.wait_with_output().unwrap();
    assert_eq!(
        v.status.code(),
        Some(1),
        "verify must fail on the rewrite: {}{}",
        String::from_utf8_lossy(&v.stderr),
        String::from_utf8_lossy(&v.stdout)
    );
    let html = std::fs::read_to_string(&out).unwrap();
    for fetch in ["src=\"http", "href=\"http", "<script src", "url("] {
        assert!(!html.contains(fetch), "the report fetches something: {fetch}");
    }
    let shots2 = images();
    in_netns(&mgmt, move || {
        let b = Browser::start();
        b.go(&format!("file://{}", out.display()));
        b.wait_for("the report", "return document.readyState === 'complete'");
        assert_eq!(
            b.js("return document.querySelector('#verdict').textContent"),
            json!("FAIL")
        );
        let failing: Vec<String> = serde_json::from_value(
            b.js("return [...document.querySelectorAll('tr.check.fail')].map(r => r.dataset.check)"),
        )
        .unwrap();
        assert!(failing.iter().any(|c| c.contains("class")), "{failing:?}");
        let failed_at: Vec<String> = serde_json::from_value(b.js(
            "return [...document.querySelectorAll('#map .node, #map .link')].filter(e => (e.dataset.marks || '').split(' ').includes('check_failed')).map(e => e.dataset.node || (e.dataset.a + '-' + e.dataset.b))",
        ))
        .unwrap();
        assert!(failed_at.contains(&"s1".to_string()), "{failed_at:?}");
        assert!(
            !failed_at.iter().any(|p| p == "s2" || p.contains("s2")),
            "a healthy spine marked: {failed_at:?}"
        );
        let drawn = b.js("return document.querySelectorAll('section.failure .evidence-flow svg').length");
        assert!(drawn.as_u64().unwrap() > 0, "no evidence flow drawn");
        let errors = b.console_errors();
        assert!(errors.is_empty(), "console errors: {errors:?}");
        b.screenshot(&shots2.join("verify-report.png"));
    });
    drop(obs);
}
