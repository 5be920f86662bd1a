//! The server as a client meets it: `stoke-serve` started on 127.0.0.1 with the default model on
//! the CPU (`Stoke<NdArray>`), then the official `openai` Python client against it, ten thousand
//! malformed requests, a client that leaves mid-stream, a full queue, a deadline, an oversized
//! body, and SIGTERM.

use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server process, killed when dropped.
struct Server {
    child: Child,
    url: String,
    addr: String,
}

impl Server {
    /// Starts `stoke-serve` on a free port with `args` and waits until it listens.
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_stoke-serve"))
            .args(["--device", "cpu", "--port", "0", "--context", "1024"])
            .args(args)
            .env("RUST_LOG", "stoke_serve=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting stoke-serve");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[server] {line}");
                if let Some(rest) = line.split("on http://").nth(1) {
                    let addr = rest
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(600))
            .expect("the server did not start listening within 600 s");
        Server {
            child,
            url: format!("http://{addr}"),
            addr,
        }
    }

    /// Sends raw bytes and returns the response's status (None: closed without one).
    fn raw(&self, bytes: &[u8]) -> Option<u16> {
        let mut s = TcpStream::connect(&self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The server may answer (and close) before it has read everything. The write side stays
        // open: the server takes a half-closed connection as one the client gave up on.
        let _ = s.write_all(bytes);
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            }
        }
        let head = String::from_utf8_lossy(&buf);
        head.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
    }

    fn post(&self, path: &str, body: &str) -> (u16, String) {
        post(&self.addr, path, body)
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, body) = self.get("/metrics");
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in\n{body}"))
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        (status_of(&out), out)
    }
}

/// POSTs `body` as JSON to `path` and returns the status and the whole response.
fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    (status_of(&out), out)
}

/// A response's status (0: none).
fn status_of(response: &str) -> u16 {
    response
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const GOOD: &str = r#"{"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}"#;

/// The `openai` package's Python: `STOKE_OPENAI_PYTHON`, or `.venv-openai` at the workspace
/// root, made by `scripts/openai-venv.sh` (pip) where it is missing. `Err`: why there is none.
fn openai_python() -> Result<String, String> {
    if let Ok(p) = std::env::var("STOKE_OPENAI_PYTHON") {
        return Ok(p);
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let python = format!("{root}/.venv-openai/bin/python");
    let ok = |p: &str| {
        Command::new(p)
            .args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if ok(&python) {
        return Ok(python);
    }
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/openai-venv.sh"))
        .output()
        .map_err(|e| format!("running scripts/openai-venv.sh: {e}"))?;
    if out.status.success() && ok(&python) {
        Ok(python)
    } else {
        Err(format!(
            "scripts/openai-venv.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn the_openai_client_gets_what_it_asks_for() {
    let python = match openai_python() {
        Ok(p) => p,
        Err(why) => {
            assert!(
                std::env::var("STOKE_REQUIRE_OPENAI").is_err(),
                "STOKE_REQUIRE_OPENAI is set and there is no openai client: {why}"
            );
            println!("skipped: no openai Python client ({why})");
            return;
        }
    };
    let server = Server::start(&["--max-running", "8"]);
    let model = stoke_llama::fetch::DEFAULT_MODEL_FILE;
    let out = Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai_client.py"
        ))
        .args([&server.url, model])
        .output()
        .expect("running the openai client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the openai client failed:\n{stdout}\n{stderr}"
    );
}

/// A malformed request: the bytes sent, and what kind it is.
fn malformed(rng: &mut rand::rngs::StdRng, limit: usize) -> (Vec<u8>, &'static str) {
    let valid = r#"{"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "Hello", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "n": 1, "stream": false, "stop": ["x"], "seed": 7, "logprobs": 1}"#;
    let http = |path: &str, body: &[u8], ctype: &str| {
        let mut r = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    };
    let path = if rng.random_bool(0.5) {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    };
    // Field values that no field takes.
    let bad_values = [
        r#""hot""#,
        "-1",
        "1e400",
        "18446744073709551616",
        "-9223372036854775809",
        "1.5",
        "[]",
        "{}",
        "null",
        "true",
        r#"[[1,"a"]]"#,
        r#"{"a": [1, {"b": null}]}"#,
        "1e30",
        "-1e30",
        "0",
        "99999999999",
        r#""""#,
        r#"[""]"#,
        r#"[99999999]"#,
    ];
    // Fields each of the values above is wrong for (on both endpoints).
    let fields = [
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "logprobs",
        "top_k",
        "repetition_penalty",
        "stream",
        "stop_token_ids",
    ];
    match rng.random_range(0..10) {
        // Truncated JSON.
        0 => {
            let cut = rng.random_range(0..valid.len() - 1);
            (
                http(path, &valid.as_bytes()[..cut], "application/json"),
                "truncated",
            )
        }
        // Random bytes, invalid UTF-8 included.
        1 => {
            let n = rng.random_range(1..512);
            let b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            (http(path, &b, "application/json"), "random bytes")
        }
        // Invalid UTF-8 inside a string.
        2 => {
            let mut b = br#"{"prompt": "Hel"#.to_vec();
            b.extend([0xff, 0xfe, 0xc3]);
            b.extend_from_slice(br#"lo", "messages": [{"role": "user", "content": "x"#);
            b.push(0x80);
            b.extend_from_slice(br#""}], "max_tokens": 2}"#);
            (http(path, &b, "application/json"), "invalid utf-8")
        }
        // A wrong or out-of-range value in a field.
        3 | 4 => {
            let field = fields[rng.random_range(0..fields.len())];
            let mut value = bad_values[rng.random_range(0..bad_values.len())];
            // Values that are right for some fields.
            let fine = match field {
                "stream" => value == "true" || value == "null",
                "stop_token_ids" => value == "[]" || value == "null",
                "top_k" => value == "0" || value == "-1" || value == "null",
                "temperature" => value == "0" || value == "1.5" || value == "null",
                "logprobs" => value == "0" || value == "null" || value == "true",
                _ => value == "null" || value == "1.5" && field == "repetition_penalty",
            };
            if fine {
                value = r#""hot""#;
            }
            let body = if path == "/v1/completions" {
                format!(r#"{{"prompt": "Hi", "max_tokens": 2, "{field}": {value}}}"#)
            } else {
                format!(
                    r#"{{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 2, "{field}": {value}}}"#
                )
            };
            (http(path, body.as_bytes(), "application/json"), "bad field")
        }
        // Wrong prompt or messages.
        5 => {
            let bodies = [
                r#"{"prompt": ""}"#,
                r#"{"prompt": []}"#,
                r#"{"prompt": [-1]}"#,
                r#"{"prompt": [4294967296]}"#,
                r#"{"prompt": [1, 2, 99999999]}"#,
                r#"{"prompt": {"text": "x"}}"#,
                r#"{"prompt": 12}"#,
                r#"{"max_tokens": 2}"#,
                r#"{"messages": []}"#,
                r#"{"messages": "hi"}"#,
                r#"{"messages": [{"role": 1, "content": "x"}]}"#,
                r#"{"messages": [{"content": "x"}]}"#,
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
                r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
                r#"{"prompt": "x", "max_tokens": 5000}"#,
                r#"{"prompt": "x", "stop": ["", "a"]}"#,
                r#"{"prompt": "x", "echo": true}"#,
                r#"{"prompt": "x", "frequency_penalty": 1}"#,
                r#"{"prompt": "x", "logit_bias": {"1": 5}}"#,
                r#"{"prompt": "x", "model": "gpt-4"}"#,
                r#"{"prompt": "x", "stream_options": {"include_usage": true}}"#,
                r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}"#,
                r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}"#,
                "[1, 2, 3]",
                "\"a string\"",
                "{\"prompt\": \"x\"} {\"prompt\": \"y\"}",
            ];
            let b = bodies[rng.random_range(0..bodies.len())];
            // The completions bodies go to completions, the chat ones to chat.
            let p = if b.contains("messages") {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            (http(p, b.as_bytes(), "application/json"), "bad prompt")
        }
        // Deep nesting.
        6 => {
            let depth = rng.random_range(129..20_000);
            let body = format!(
                r#"{{"prompt": {}1{}}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            );
            (
                http(path, body.as_bytes(), "application/json"),
                "deep nesting",
            )
        }
        // Over the body limit.
        7 => {
            let n = limit + rng.random_range(1..4096);
            let body = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(n));
            (http(path, body.as_bytes(), "application/json"), "oversized")
        }
        // Broken headers and request lines.
        8 => {
            let reqs: [&[u8]; 8] = [
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHo\xffst: x\r\n\r\n",
                b"POST /v1/comp\x00letions HTTP/1.1\r\nHost: x\r\n\r\n",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http",
                b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n",
            ];
            (
                reqs[rng.random_range(0..reqs.len())].to_vec(),
                "bad headers",
            )
        }
        // Wrong method or path, and a huge header.
        _ => match rng.random_range(0..3) {
            0 => (
                b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
                "wrong method",
            ),
            1 => (http("/v1/nothing", b"{}", "application/json"), "wrong path"),
            _ => {
                let mut r = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
                r.extend(std::iter::repeat_n(b'a', 1 << 20));
                r.extend_from_slice(b"\r\n\r\n{}");
                (r, "huge header")
            }
        },
    }
}

#[test]
fn ten_thousand_malformed_requests_get_4xx_and_the_server_keeps_serving() {
    let limit = 65536;
    let mut server = Server::start(&["--max-running", "2", "--max-body-bytes", &limit.to_string()]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(53);
    let mut by_status = std::collections::BTreeMap::<String, usize>::new();
    let mut bad = Vec::new();
    let n = 10_000;
    for i in 0..n {
        let (req, kind) = malformed(&mut rng, limit);
        let status = server.raw(&req);
        let key = status.map_or("closed".to_string(), |s| s.to_string());
        *by_status.entry(key).or_default() += 1;
        match status {
            Some(s) if (400..500).contains(&s) => {}
            None if kind == "bad headers" || kind == "huge header" => {}
            other => bad.push(format!(
                "#{i} ({kind}): {other:?} for {:?}",
                String::from_utf8_lossy(&req[..req.len().min(300)])
            )),
        }
    }
    println!("{n} malformed requests, by status: {by_status:?}");
    assert!(
        bad.is_empty(),
        "{} requests were not refused with a 4xx:\n{}",
        bad.len(),
        bad[..bad.len().min(20)].join("\n")
    );
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "the server exited"
    );
    let (status, body) = server.post("/v1/completions", GOOD);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_client_that_leaves_mid_stream_frees_its_pages() {
    let server = Server::start(&["--max-running", "2"]);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0, "stream": true, "ignore_eos": true}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = TcpStream::connect(&server.addr).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut events = 0;
    let mut line = String::new();
    while events < 3 {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line.starts_with("data: {") {
            events += 1;
        }
    }
    assert!(server.metric("stoke_kv_pages_used") > 0.0);
    drop(r);
    drop(s);
    let t = Instant::now();
    while server.metric("stoke_kv_pages_used") > 0.0
        || server.metric("stoke_requests_running") > 0.0
    {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the pages were not freed within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(server.metric("stoke_client_disconnects_total"), 1.0);
    let (status, body) = server.post("/v1/completions", GOOD);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn limits_queue_deadline_body_and_sigterm() {
    let server = Server::start(&[
        "--max-running",
        "1",
        "--max-waiting",
        "1",
        "--request-timeout",
        "4",
        "--max-body-bytes",
        "8192",
        "--shutdown-grace",
        "1",
    ]);
    // Over the body limit: 413 in the API's error shape.
    let (status, body) = server.post(
        "/v1/completions",
        &format!(r#"{{"prompt": "{}"}}"#, "a".repeat(10_000)),
    );
    assert_eq!(status, 413, "{body}");
    assert!(body.contains(r#""error""#), "{body}");
    // A prompt over the context: 400 naming it.
    let (status, body) = server.post(
        "/v1/completions",
        &format!(
            r#"{{"prompt": [{}], "max_tokens": 1}}"#,
            vec!["1"; 1024].join(",")
        ),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("context_length_exceeded"), "{body}");
    // One running, one waiting: the next ones get 429 with Retry-After; the running one ends at
    // its deadline with 504.
    let long = r#"{"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true}"#;
    let mut handles = Vec::new();
    for _ in 0..2 {
        let addr = server.addr.clone();
        handles.push(std::thread::spawn(move || {
            post(&addr, "/v1/completions", long)
        }));
        std::thread::sleep(Duration::from_millis(300));
    }
    std::thread::sleep(Duration::from_millis(500));
    let (status, body) = server.post("/v1/completions", GOOD);
    assert_eq!(status, 429, "{body}");
    assert!(body.to_lowercase().contains("retry-after: 1"), "{body}");
    for h in handles {
        let (status, body) = h.join().unwrap();
        assert_eq!(status, 504, "{body}");
    }
    assert!(server.metric("stoke_deadline_exceeded_total") >= 1.0);
    // SIGTERM with a request in flight: it is ended after the grace period, the process exits 0.
    let streaming =
        r#"{"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true, "stream": true}"#;
    let addr = server.addr.clone();
    let inflight = std::thread::spawn(move || post(&addr, "/v1/completions", streaming));
    std::thread::sleep(Duration::from_millis(1500));
    let mut server = server;
    let pid = server.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let t = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the server did not exit within 60 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "exit status {status:?}");
    // The grace period (1 s) and the in-flight request's end, not a wait on idle handles.
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "exit took {:?}",
        t.elapsed()
    );
    let (code, body) = inflight.join().unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("shut down") && body.contains("[DONE]"),
        "{body}"
    );
}
