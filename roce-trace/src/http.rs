//! The HTTP side of the collector's JSON API and both Prometheus endpoints: GET requests
//! served by hyper (through axum), answered by a plain function of path and query.

use std::{future::Future, net::SocketAddr, sync::Arc};

use tokio::net::TcpListener;

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
            content_type: crate::metrics::CONTENT_TYPE,
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

impl Response {
    fn into_axum(self) -> axum::response::Response {
        let status = axum::http::StatusCode::from_u16(self.status)
            .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(axum::http::header::CONTENT_TYPE, self.content_type)],
            self.body,
        )
            .into_response()
    }
}

use axum::response::IntoResponse as _;

/// Binds `addr`; returns the bound address and a future serving `handler(path, query)`
/// for GET requests (others get 405) with hyper, through axum. Answers are built on a
/// blocking thread: a large view never holds up the runtime the agents' connections
/// share.
pub async fn bind<H>(addr: SocketAddr, handler: H) -> std::io::Result<(SocketAddr, impl Future<Output = ()>)>
where
    H: Fn(&str, &str) -> Response + Send + Sync + 'static,
{
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let handler = Arc::new(handler);
    let app = axum::Router::new().fallback(move |method: axum::http::Method, uri: axum::http::Uri| {
        let handler = handler.clone();
        async move {
            if method != axum::http::Method::GET {
                return Response::text(405, "only GET\n".into()).into_axum();
            }
            let (path, query) = (uri.path().to_owned(), uri.query().unwrap_or("").to_owned());
            tokio::task::spawn_blocking(move || handler(&path, &query))
                .await
                .unwrap_or_else(|e| Response::text(500, format!("the request failed: {e}\n")))
                .into_axum()
        }
    });
    Ok((local, async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("HTTP on {local} stopped: {e}");
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
