//! A small HTTP/1.1 server for GET requests: the collector's JSON API and the Prometheus
//! endpoints. Each request is answered and the connection closed.

use std::{future::Future, net::SocketAddr, sync::Arc};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn json<T: serde::Serialize>(v: &T) -> Self {
        match serde_json::to_string_pretty(v) {
            Ok(body) => Self {
                status: 200,
                content_type: "application/json",
                body,
            },
            Err(e) => Self::text(500, format!("encoding failed: {e}\n")),
        }
    }
    pub fn text(status: u16, body: String) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body,
        }
    }
    pub fn metrics(body: String) -> Self {
        Self {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body,
        }
    }
}

/// Encodes a query value: everything but ASCII letters and digits as `%XX`.
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Decodes `%XX` escapes (two hex digits; a `%` before anything else stays) and `+` in
/// a query value.
pub fn percent_decode(s: &str) -> String {
    let hex = |c: u8| (c as char).to_digit(16);
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
            (b'+', ..) => out.push(b' '),
            (c, ..) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The path and query of a GET request's head (`GET /flow?id=x HTTP/1.1…`), or the
/// answer to any other request: 405 for another method, 400 for no target.
pub fn request_target(head: &str) -> Result<(&str, &str), Response> {
    let mut parts = head.split_whitespace();
    match (parts.next(), parts.next()) {
        (Some("GET"), Some(target)) => Ok(target.split_once('?').unwrap_or((target, ""))),
        (Some(_), Some(_)) => Err(Response::text(405, "only GET\n".into())),
        _ => Err(Response::text(400, "bad request\n".into())),
    }
}

/// Binds `addr`; returns the bound address and a future serving `handler(path, query)`.
pub async fn bind<H>(addr: SocketAddr, handler: H) -> std::io::Result<(SocketAddr, impl Future<Output = ()>)>
where
    H: Fn(&str, &str) -> Response + Send + Sync + 'static,
{
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let handler = Arc::new(handler);
    Ok((local, async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut n = 0;
                // Read the request head (bounded); the body of a GET is ignored.
                while n < buf.len() {
                    match tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf[n..]))
                        .await
                    {
                        Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                        Ok(Ok(k)) => n += k,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let head = String::from_utf8_lossy(&buf[..n]);
                // Answers are built on a blocking thread: a large view never holds up
                // the runtime the agents' connections share.
                let resp = match request_target(&head) {
                    Ok((path, query)) => {
                        let (path, query) = (path.to_owned(), query.to_owned());
                        tokio::task::spawn_blocking(move || handler(&path, &query))
                            .await
                            .unwrap_or_else(|e| Response::text(500, format!("the request failed: {e}\n")))
                    }
                    Err(refusal) => refusal,
                };
                let reason = match resp.status {
                    200 => "OK",
                    404 => "Not Found",
                    405 => "Method Not Allowed",
                    _ => "Error",
                };
                let out = format!(
                    "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                    resp.status,
                    resp.content_type,
                    resp.body.len(),
                    resp.body
                );
                let _ = sock.write_all(out.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    }))
}

/// GET a JSON document (the collector's API) over a fresh connection.
pub fn get_json<T: serde::de::DeserializeOwned>(addr: SocketAddr, path: &str) -> anyhow::Result<T> {
    use std::io::{Read, Write};

    use anyhow::Context as _;
    let mut s = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(3))
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)
        .with_context(|| format!("reading {addr}{path}"))?;
    let (head, body) = out.split_once("\r\n\r\n").context("malformed HTTP answer")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{addr}{path}: {}", body.trim());
    serde_json::from_str(body).with_context(|| format!("{addr}{path}: not the expected JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_coding_round_trips() {
        let id = "fd00::1:49152>fd00::2/0x101";
        assert_eq!(percent_decode(&percent_encode(id)), id);
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode("10.0.0.1%3A49152%3E10.0.0.2%2F0x101"),
            "10.0.0.1:49152>10.0.0.2/0x101"
        );
        assert_eq!(percent_decode("a+b%"), "a b%");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("%41%4"), "A%4");
    }

    /// Found by the `http` fuzz harness (fuzz/corpus/http/crash-percent-sign-digit): the
    /// two characters after `%` went to `u8::from_str_radix`, which takes a sign, so `%+1`
    /// decoded to byte 1 instead of staying as written.
    #[test]
    fn a_percent_before_a_sign_is_not_an_escape() {
        assert_eq!(percent_decode("a+b%+1%zz%4%"), "a b% 1%zz%4%");
        assert_eq!(percent_decode("%+f"), "% f");
        assert_eq!(percent_decode("%-1"), "%-1");
    }
}
