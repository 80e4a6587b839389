package node

import (
	"fmt"
	"net"
	"net/url"
	"strings"

	"github.com/kvactors/kvactors/natsauth"
)

// checkAddresses refuses, as a config error (exit 2), an admin address or a
// NATS URL that cannot be used as written: otherwise the first would fail
// only at listen time and the second be retried for the whole connect
// timeout, both exiting 1, which a supervisor restarts for ever.
func (c Config) checkAddresses() error {
	if c.HTTPAddr != HTTPOff {
		_, port, err := net.SplitHostPort(c.HTTPAddr)
		if err == nil {
			// 0..65535 or a service name, as net.Listen reads it.
			_, err = net.LookupPort("tcp", port)
		}
		if err != nil {
			return fmt.Errorf("%w: --http %q: want host:port (port 0: any free port; off: no admin server): %w",
				ErrConfig, c.HTTPAddr, err)
		}
	}
	if c.NATSURL != "" {
		if err := CheckNATSURLs(c.NATSURL); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	return nil
}

// CheckNATSURLs checks a comma-separated list of NATS server URLs as nats.go
// reads them (a missing scheme is nats://): each parses and names a host,
// and none carries credentials. Secrets come from the environment only
// (NATS_USER, NATS_PASSWORD, NATS_TOKEN): a URL's would show in ps, in
// config repositories and in every log line that names the server.
func CheckNATSURLs(urls string) error {
	for _, raw := range strings.Split(urls, ",") {
		raw = strings.TrimSpace(raw)
		s := raw
		if !strings.Contains(s, "://") {
			s = "nats://" + s
		}
		u, err := url.Parse(s)
		if err != nil {
			return fmt.Errorf("--nats %q: %w", redactedURL(raw), err)
		}
		switch {
		case u.User != nil:
			return fmt.Errorf("--nats %q carries credentials: put them in NATS_USER and NATS_PASSWORD, or NATS_TOKEN (the environment only)",
				redactedURL(raw))
		case u.Hostname() == "":
			return fmt.Errorf("--nats %q names no host", raw)
		}
		if p := u.Port(); p != "" { // url.Parse takes any digits
			if _, err := net.LookupPort("tcp", p); err != nil {
				return fmt.Errorf("--nats %q: bad port: %w", redactedURL(raw), err)
			}
		}
	}
	return nil
}

// redactedURL is raw with anything before an '@' in its authority hidden,
// for an error message about a URL that may not parse.
func redactedURL(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		scheme, rest = "", raw
	}
	host := rest
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		host = rest[:i]
	}
	if at := strings.LastIndex(host, "@"); at >= 0 {
		rest = "REDACTED@" + rest[at+1:]
	}
	if ok {
		return scheme + "://" + rest
	}
	return rest
}

// checkSecretFile reads a NATS secret file ("" passes: none) and parses it
// as the connection will: a creds file holds a user JWT and an nkey seed,
// a CA file PEM certificates, an nkey file a seed. A malformed one would
// otherwise fail every connect attempt for the whole connect timeout and
// exit 1.
func checkSecretFile(flag, path string) error {
	if path == "" {
		return nil
	}
	data, err := readFile(path)
	if err != nil {
		return err
	}
	switch flag {
	case "--nats-creds":
		err = natsauth.CheckCreds(data)
	case "--nats-ca":
		err = natsauth.CheckCA(data)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil // --nats-nkey: nats.NkeyOptionFromSeed parses it (NATSAuthOptions)
}
