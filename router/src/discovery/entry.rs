//! What a `--prefill`/`--decode` entry names: one worker at a fixed `http(s)://HOST:PORT`, or
//! `dns://NAME:PORT`, every address of NAME being a worker at PORT. Parsing only: the
//! configuration checks entries with it, and the pool and discovery act on what it gives.

const DNS_SCHEME: &str = "dns://";

/// One `--prefill`/`--decode` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEntry {
    /// One worker at this URL (`http(s)://HOST:PORT`, no trailing slash).
    Url(String),
    /// Every address `name` resolves to is a worker at `port`.
    Dns(DnsName),
}

/// A name to resolve and the port its workers listen on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsName {
    pub name: String,
    pub port: u16,
}

impl std::fmt::Display for DnsName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.name.contains(':') {
            write!(f, "{DNS_SCHEME}[{}]:{}", self.name, self.port)
        } else {
            write!(f, "{DNS_SCHEME}{}:{}", self.name, self.port)
        }
    }
}

impl WorkerEntry {
    /// Parses an entry, trimmed and without a trailing slash; the error says what is wrong.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let entry = raw.trim().trim_end_matches('/');
        if let Some(rest) = entry.strip_prefix(DNS_SCHEME) {
            return parse_dns(rest)
                .map(WorkerEntry::Dns)
                .ok_or_else(|| format!("`{entry}` must look like dns://NAME:PORT"));
        }
        let uri: axum::http::Uri = entry
            .parse()
            .map_err(|_| format!("`{entry}` is not a valid URL"))?;
        let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
        let path_ok = matches!(uri.path(), "" | "/");
        if !scheme_ok || uri.host().is_none() || !path_ok {
            return Err(format!(
                "`{entry}` must look like http://HOST:PORT or dns://NAME:PORT"
            ));
        }
        Ok(WorkerEntry::Url(entry.to_string()))
    }

    /// The normalised text of the entry (what `parse` accepts back).
    pub fn to_text(&self) -> String {
        match self {
            WorkerEntry::Url(url) => url.clone(),
            WorkerEntry::Dns(dns) => dns.to_string(),
        }
    }
}

/// `NAME:PORT` or `[V6]:PORT`, with a non-zero port and a name of host-name characters.
fn parse_dns(rest: &str) -> Option<DnsName> {
    let (name, port) = rest.rsplit_once(':')?;
    let name = match name.strip_prefix('[') {
        Some(v6) => v6.strip_suffix(']')?,
        None => name,
    };
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    let name_ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'));
    name_ok.then(|| DnsName {
        name: name.to_string(),
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls_and_names() {
        assert_eq!(
            WorkerEntry::parse(" http://10.0.0.2:7201/ "),
            Ok(WorkerEntry::Url("http://10.0.0.2:7201".into()))
        );
        let dns = WorkerEntry::parse("dns://tandem-decode.tandem.svc.cluster.local:7201");
        assert_eq!(
            dns,
            Ok(WorkerEntry::Dns(DnsName {
                name: "tandem-decode.tandem.svc.cluster.local".into(),
                port: 7201
            }))
        );
        assert_eq!(
            dns.unwrap().to_text(),
            "dns://tandem-decode.tandem.svc.cluster.local:7201"
        );
        let v6 = WorkerEntry::parse("dns://[::1]:7201").unwrap();
        assert_eq!(v6.to_text(), "dns://[::1]:7201");
        for bad in [
            "dns://name",
            "dns://name:0",
            "dns://name:99999",
            "dns://:7201",
            "dns://a/b:1",
            "dns://na me:1",
            "127.0.0.1:7201",
            "http://a:1/path",
            "ftp://a:1",
        ] {
            assert!(WorkerEntry::parse(bad).is_err(), "{bad}");
        }
    }
}
