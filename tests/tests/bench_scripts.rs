//! The measuring scripts' own arithmetic, on inputs whose answer is known: a figure a
//! decision rests on must come out right where it can be worked out by hand.

use std::process::Command;

/// `scripts/bench-at-once`'s code-lines figure (`code_lines`) on a made-up image of 300
/// three-byte instructions, loaded at four places in its lines: an instruction starts a
/// line of code at some of them and not at others. Samples spread evenly must read 1.00
/// and cost nothing; three times the samples wherever an instruction starts a line must
/// read 3.00, what those extra samples are of the whole.
#[test]
fn code_lines_tells_what_starting_a_line_costs() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench-at-once");
    let program = r#"
import importlib.machinery, importlib.util, os, sys, tempfile
spec = importlib.util.spec_from_loader("bao", importlib.machinery.SourceFileLoader("bao", sys.argv[1]))
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
d = tempfile.TemporaryDirectory()
image = os.path.join(d.name, "image.bin")
with open(image, "wb") as f:
    f.write(bytes([0x48, 0x89, 0xc0]) * 300)  # mov %rax,%rax
ins = m.instructions(image)
assert ins[:3] == [(0, 3), (3, 3), (6, 3)] and len(ins) == 300, ins[:3]
phases = (0, 16, 32, 48)
even = {(off, p): 10 for off, _ in ins for p in phases}
print(m.code_lines(image, even))
starts = {}
extra = 0
for i, (off, n) in enumerate(ins):
    for p in phases:
        start = i > 0 and (p + off + n - 1) // 64 != (p + ins[i - 1][0]) // 64
        starts[(off, p)] = 30 if start else 10
        extra += 20 if start else 0
print(m.code_lines(image, starts))
print(f"{extra / sum(starts.values()):.1%}")
d.cleanup()
"#;
    let out = Command::new("python3")
        .args(["-c", program, script])
        .output()
        .expect("python3 (./scripts/setup installs it)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(lines[0].contains("(1.00)"), "even: {}", lines[0]);
    assert!(lines[0].contains("costs about 0.0% "), "even: {}", lines[0]);
    assert!(lines[1].contains("(3.00)"), "three times: {}", lines[1]);
    let share = lines[2];
    assert!(
        lines[1].contains(&format!("costs about {share} ")),
        "three times: {} (the extra samples are {share} of all)",
        lines[1]
    );
}
