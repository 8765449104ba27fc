//! The HTTP side of the collector's JSON API and both Prometheus endpoints: GET requests
//! served by hyper (through axum), answered by a plain function of path and query.

use std::{future::Future, net::SocketAddr, sync::Arc};

use tokio::net::TcpListener;

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Body,
}

/// What an answer carries: text built whole, or text written as it is produced.
pub enum Body {
    Text(String),
    /// Written on a blocking thread into chunks sent as they fill ([`STREAM_CHUNK`]
    /// bytes, at most [`STREAM_AHEAD`] of them ahead of the client), so an answer of any
    /// size holds a bounded amount of memory; a client that goes away stops the writer
    /// at its next chunk. An error after the first chunk can only cut the answer short.
    Stream(WriteBody),
}

/// What writes a streamed answer ([`Body::Stream`]).
pub type WriteBody = Box<dyn FnOnce(&mut ChunkWriter) -> std::io::Result<()> + Send>;

/// The size of a streamed answer's chunks.
pub const STREAM_CHUNK: usize = 256 * 1024;
/// How many chunks a streamed answer's writer may be ahead of its client.
pub const STREAM_AHEAD: usize = 4;

impl Response {
    /// `v` as JSON, written as it is serialised ([`Body::Stream`]): for answers as
    /// large as the tables they show.
    pub fn json_streamed<T: serde::Serialize + Send + 'static>(v: T) -> Self {
        Self {
            status: 200,
            content_type: "application/json",
            body: Body::Stream(Box::new(move |w| {
                serde_json::to_writer_pretty(&mut *w, &v).map_err(std::io::Error::other)?;
                std::io::Write::flush(w)
            })),
        }
    }

    pub fn json<T: serde::Serialize>(v: &T) -> Self {
        match serde_json::to_string_pretty(v) {
            Ok(body) => Self {
                status: 200,
                content_type: "application/json",
                body: Body::Text(body),
            },
            Err(e) => Self::text(500, format!("encoding failed: {e}\n")),
        }
    }
    pub fn text(status: u16, body: String) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: Body::Text(body),
        }
    }
    pub fn html(body: String) -> Self {
        Self {
            status: 200,
            content_type: "text/html; charset=utf-8",
            body: Body::Text(body),
        }
    }
    pub fn metrics(body: String) -> Self {
        Self {
            status: 200,
            content_type: crate::metrics::CONTENT_TYPE,
            body: Body::Text(body),
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
    /// The answer for hyper. Called on the blocking thread the handler ran on: a
    /// streamed body's writer goes on running there, handing chunks to the runtime.
    fn into_axum(self) -> axum::response::Response {
        let status = axum::http::StatusCode::from_u16(self.status)
            .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        let body = match self.body {
            Body::Text(t) => axum::body::Body::from(t),
            Body::Stream(write) => {
                let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(STREAM_AHEAD);
                tokio::task::spawn_blocking(move || {
                    let mut w = ChunkWriter {
                        buf: Vec::with_capacity(STREAM_CHUNK),
                        tx,
                    };
                    if let Err(e) = write(&mut w) {
                        tracing::debug!("a streamed answer stopped: {e}");
                    }
                });
                axum::body::Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv()
                        .await
                        .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
                }))
            }
        };
        (
            status,
            [(axum::http::header::CONTENT_TYPE, self.content_type)],
            body,
        )
            .into_response()
    }
}

/// A streamed answer's writer side: fills a chunk, sends it when full (waiting while the
/// client is [`STREAM_AHEAD`] chunks behind), fails once the client is gone. A concrete
/// type, so a serialiser's many small writes are appends, not calls through a vtable.
pub struct ChunkWriter {
    buf: Vec<u8>,
    tx: tokio::sync::mpsc::Sender<bytes::Bytes>,
}

impl ChunkWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(STREAM_CHUNK));
        self.tx
            .blocking_send(chunk.into())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client went away"))
    }
}

impl std::io::Write for ChunkWriter {
    #[inline]
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.write_all(b)?;
        Ok(b.len())
    }

    #[inline]
    fn write_all(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= STREAM_CHUNK {
            self.send()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

use axum::response::IntoResponse as _;

/// The one path served without the bearer token: the web view's page, which holds no
/// data (`roce_trace_report::html::app_page`).
pub const PUBLIC_PAGE: &str = "/";

/// Binds `addr`; returns the bound address and a future serving `handler(path, query)`
/// for GET requests (others get 405) with hyper, through axum. Answers are built on a
/// blocking thread: a large view never holds up the runtime the agents' connections
/// share. With a `bearer` token, a request without `Authorization: Bearer <token>` is
/// answered 401 and nothing else (compared in constant time).
pub async fn bind<H>(
    addr: SocketAddr,
    bearer: Option<Arc<str>>,
    handler: H,
) -> std::io::Result<(SocketAddr, impl Future<Output = ()>)>
where
    H: Fn(&str, &str) -> Response + Send + Sync + 'static,
{
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let handler = Arc::new(handler);
    let app = axum::Router::new().fallback(
        move |method: axum::http::Method, uri: axum::http::Uri, headers: axum::http::HeaderMap| {
            let handler = handler.clone();
            let bearer = bearer.clone();
            async move {
                // The web view's page holds no data (its script fetches the fragments,
                // which ask for the token): a browser can load it and ask the user.
                let open = uri.path() == PUBLIC_PAGE;
                if let Some(want) = bearer.as_ref().filter(|_| !open) {
                    let given = headers
                        .get(axum::http::header::AUTHORIZATION)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("Bearer "))
                        .unwrap_or("");
                    if !same_secret(given.trim().as_bytes(), want.as_bytes()) {
                        let mut r = Response::text(
                            401,
                            "a bearer token is required (Authorization: Bearer …)\n".into(),
                        )
                        .into_axum();
                        r.headers_mut().insert(
                            axum::http::header::WWW_AUTHENTICATE,
                            axum::http::HeaderValue::from_static("Bearer realm=\"roce-trace\""),
                        );
                        return r;
                    }
                }
                if method != axum::http::Method::GET {
                    return Response::text(405, "only GET\n".into()).into_axum();
                }
                let (path, query) = (uri.path().to_owned(), uri.query().unwrap_or("").to_owned());
                tokio::task::spawn_blocking(move || handler(&path, &query).into_axum())
                    .await
                    .unwrap_or_else(|e| Response::text(500, format!("the request failed: {e}\n")).into_axum())
            }
        },
    );
    Ok((local, async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("HTTP on {local} stopped: {e}");
        }
    }))
}

/// Whether two secrets are equal, in time that depends on their lengths only, never on
/// where they first differ.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..n {
        let (x, y) = (a.get(i).copied().unwrap_or(0), b.get(i).copied().unwrap_or(0));
        diff |= std::hint::black_box(x ^ y);
    }
    diff == 0
}

/// GET a JSON document (the collector's API) over a fresh connection.
pub fn get_json<T: serde::de::DeserializeOwned>(addr: SocketAddr, path: &str) -> anyhow::Result<T> {
    get_json_as(addr, path, None)
}

/// [`get_json`] with a bearer token, for an API that asks for one.
pub fn get_json_as<T: serde::de::DeserializeOwned>(
    addr: SocketAddr,
    path: &str,
    bearer: Option<&str>,
) -> anyhow::Result<T> {
    use anyhow::Context as _;
    let (status, body) = get_as(addr, path, std::time::Duration::from_secs(30), bearer)?;
    anyhow::ensure!(
        status == 200,
        "{addr}{path}: {status} {}",
        String::from_utf8_lossy(&body).trim()
    );
    serde_json::from_slice(&body).with_context(|| format!("{addr}{path}: not the expected JSON"))
}

/// GET `path` over a fresh HTTP/1.1 connection: the status and the body, read as the
/// answer frames it (chunked, a length, or up to the close), each read within `timeout`.
pub fn get(addr: SocketAddr, path: &str, timeout: std::time::Duration) -> anyhow::Result<(u16, Vec<u8>)> {
    get_as(addr, path, timeout, None)
}

/// [`get`] with a bearer token.
pub fn get_as(
    addr: SocketAddr,
    path: &str,
    timeout: std::time::Duration,
    bearer: Option<&str>,
) -> anyhow::Result<(u16, Vec<u8>)> {
    let auth = bearer.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    request(addr, "GET", &addr.to_string(), path, &auth, &[], timeout)
}

/// One HTTP/1.1 request to `addr` over a fresh connection (`Connection: close`), `headers`
/// (whole lines) after `Host: host`, then `body`: the answer's status and body (see
/// [`get`]), each read and write within `timeout`.
pub fn request(
    addr: SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    headers: &str,
    body: &[u8],
    timeout: std::time::Duration,
) -> anyhow::Result<(u16, Vec<u8>)> {
    use std::io::Write as _;

    use anyhow::Context as _;
    let mut s = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(3))
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n"
    )?;
    s.write_all(body)?;
    read_answer(std::io::BufReader::new(s)).with_context(|| format!("reading {addr}{path}"))
}

/// An HTTP/1.1 answer's status and body (see [`get`]).
pub fn read_answer(r: impl std::io::BufRead) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut body = Vec::new();
    let (status, _) = read_answer_to(r, &mut body)?;
    Ok((status, body))
}

/// An HTTP/1.1 answer's status, its body written to `out` as it is read (see [`get`]);
/// the body's length.
pub fn read_answer_to(
    mut r: impl std::io::BufRead,
    out: &mut impl std::io::Write,
) -> anyhow::Result<(u16, u64)> {
    use std::io::{BufRead as _, Read as _};

    use anyhow::{Context as _, bail, ensure};
    let mut line = String::new();
    let read_line = |r: &mut dyn std::io::BufRead, line: &mut String| -> anyhow::Result<()> {
        line.clear();
        // A line longer than this is not an HTTP head's.
        (&mut *r).take(64 * 1024).read_line(line)?;
        ensure!(line.ends_with('\n'), "the answer ended in its head");
        Ok(())
    };
    read_line(&mut r, &mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not an HTTP status line: {:?}", line.trim_end()))?;
    let (mut chunked, mut length) = (false, None);
    loop {
        read_line(&mut r, &mut line)?;
        let h = line.trim_end();
        if h.is_empty() {
            break;
        }
        let Some((name, value)) = h.split_once(':') else {
            bail!("not an HTTP header: {h:?}");
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse::<u64>()
                    .with_context(|| format!("content-length {value:?}"))?,
            );
        }
    }
    let mut total = 0u64;
    if chunked {
        loop {
            read_line(&mut r, &mut line)?;
            let size = line.trim_end().split(';').next().unwrap_or("").trim();
            let size = u64::from_str_radix(size, 16).with_context(|| format!("chunk size {size:?}"))?;
            if size == 0 {
                break;
            }
            let got = std::io::copy(&mut (&mut r).take(size), out)?;
            ensure!(got == size, "the answer ended in a chunk");
            total += got;
            read_line(&mut r, &mut line)?;
            ensure!(line.trim_end().is_empty(), "no line end after a chunk");
        }
    } else if let Some(n) = length {
        let got = std::io::copy(&mut (&mut r).take(n), out)?;
        ensure!(got == n, "the answer ended after {got} of {n} bytes");
        total = got;
    } else {
        total = std::io::copy(&mut r, out)?;
    }
    Ok((status, total))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A streamed answer arrives whole, and its writer stops soon after a client that
    /// read only the beginning goes away: it is never more than a few chunks (and the
    /// sockets' buffers) ahead, so an answer of any size holds bounded memory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_streamed_answer_arrives_whole_and_stops_when_its_client_goes() {
        use std::io::{Read as _, Write as _};
        use std::sync::atomic::{AtomicU64, Ordering};
        const TOTAL: u64 = 512 << 20;
        let written = Arc::new(AtomicU64::new(0));
        let ended = Arc::new(tokio::sync::Notify::new());
        let (addr, serve) = {
            let (written, ended) = (written.clone(), ended.clone());
            bind("127.0.0.1:0".parse().unwrap(), None, move |_, query| {
                let (written, ended) = (written.clone(), ended.clone());
                let total = if query == "small" { 3 << 20 } else { TOTAL };
                Response {
                    status: 200,
                    content_type: "application/octet-stream",
                    body: Body::Stream(Box::new(move |w| {
                        let line = [b'x'; 1024];
                        let mut n = 0;
                        let r = loop {
                            if n >= total {
                                break w.flush();
                            }
                            if let Err(e) = w.write_all(&line) {
                                break Err(e);
                            }
                            n += line.len() as u64;
                            written.store(n, Ordering::Relaxed);
                        };
                        ended.notify_one();
                        r
                    })),
                }
            })
            .await
            .unwrap()
        };
        tokio::spawn(serve);
        let whole = tokio::task::spawn_blocking(move || get(addr, "/?small", Duration::from_secs(10)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((whole.0, whole.1.len()), (200, 3 << 20));
        ended.notified().await;
        written.store(0, Ordering::Relaxed);
        // A client that reads 1 MiB and goes.
        tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            write!(s, "GET /?big HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut got = vec![0; 1 << 20];
            s.read_exact(&mut got).unwrap();
        })
        .await
        .unwrap();
        tokio::time::timeout(Duration::from_secs(20), ended.notified())
            .await
            .expect("the writer stopped");
        let n = written.load(Ordering::Relaxed);
        assert!(
            n < 64 << 20,
            "{n} bytes written for a client that read 1 MiB of {TOTAL}"
        );
    }

    #[test]
    fn secrets_are_equal_only_when_every_byte_and_the_length_are() {
        assert!(same_secret(b"", b""));
        assert!(same_secret(b"the-token", b"the-token"));
        for other in [
            &b"the-tokem"[..],
            b"she-token",
            b"the-toke",
            b"the-token\0",
            b"",
            b"x",
        ] {
            assert!(!same_secret(b"the-token", other), "{other:?}");
            assert!(!same_secret(other, b"the-token"), "{other:?}");
        }
    }

    /// Answers framed each way HTTP/1.1 allows read back to the same body; cut or
    /// malformed ones are errors, not a shorter body.
    #[test]
    fn answers_read_back_chunked_by_length_or_to_the_close() {
        let read = |s: &str| read_answer(s.as_bytes()).map(|(c, b)| (c, String::from_utf8(b).unwrap()));
        let ok = |b: &str| (200, b.to_string());
        assert_eq!(
            read("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n[1,\r\nA;x=y\r\n2,3,4,5,6]\r\n0\r\n\r\n").unwrap(),
            ok("[1,2,3,4,5,6]")
        );
        assert_eq!(
            read("HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnone and more").unwrap(),
            (404, "none".into())
        );
        assert_eq!(read("HTTP/1.0 200 OK\r\n\r\n{\"a\":1}").unwrap(), ok("{\"a\":1}"));
        for bad in [
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\n[1,\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
            "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n",
            "garbage\r\n\r\n",
        ] {
            assert!(read(bad).is_err(), "{bad:?}");
        }
    }

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
