//! The prefix block hashes against their test vectors (`schemas/fixtures/block_hashes.json`):
//! the Rust function and the Python reference (`schemas/examples/block_hashes.py`, written
//! apart from it) must both reproduce every case.

use std::path::Path;
use std::process::Command;

use lease_router::{block_hashes, DEFAULT_BLOCK_SIZE};

fn fixture() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/fixtures/block_hashes.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_rust_function_reproduces_every_test_vector() {
    let fixture = fixture();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 8, "{} cases", cases.len());
    let mut blocks = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let size = case["block_size"].as_u64().unwrap() as usize;
        let tokens: Vec<u32> = case["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let expected: Vec<u64> = case["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| u64::from_str_radix(h.as_str().unwrap(), 16).unwrap())
            .collect();
        assert_eq!(block_hashes(&tokens, size), expected, "{name}");
        blocks += expected.len();
    }
    assert!(blocks >= 10, "the vectors hash {blocks} blocks");
    assert_eq!(DEFAULT_BLOCK_SIZE, 16);
}

#[test]
fn the_python_reference_reproduces_every_test_vector() {
    let output = Command::new("python3")
        .args(["schemas/examples/block_hashes.py", "--check"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 runs (README's test command provides it)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("No module named 'xxhash'"),
        "the xxhash package is missing: scripts/test installs it into .tools/venv \
         (or: python3 -m pip install xxhash)"
    );
    assert!(output.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("cases reproduced"));
}
