package node_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// The deployment recipe of docs/SECURITY.md: the embedded server loads a
// generated configuration with TLS and per-engine nkeys; kvactors connects
// over TLS as its own user (--nats-ca, --nats-nkey); an engine that trusts
// the CA is served; a client that does not trust it, or has no credentials,
// is not let in.
func TestEmbeddedNATSWithAuthAndTLS(t *testing.T) {
	t.Parallel()
	certs := testkit.TLS(t)
	ca := certs.CA
	e, connect := securedNode(t, natsauth.Options{Engines: []string{"gpu0"}, TLSCert: certs.Cert, TLSKey: certs.Key},
		func(c *node.Config) { c.NATSCA = ca })
	e.nc = connect("gpu0", make(chan error, 8), nats.RootCAs(ca))
	te := e.newEngine("gpu0", defaultOpts())
	te.register()
	te.fill(0, 3, 1)
	te.send(added("r", 4), hashesEv("r", 0, hash("t", 0)), blocksEv("r", 0, 0, 3), tokensEv("r", 4, 4))
	recv(t, te.stored, "stored over TLS")

	_, err := nats.Connect(e.node.NATSURL(), nats.RootCAs(ca))
	require.ErrorIs(t, err, nats.ErrAuthorization, "TLS alone lets no one in: no credentials")
	_, err = nats.Connect(e.node.NATSURL(), nats.Timeout(2*time.Second))
	require.ErrorContains(t, err, "certificate", "the server's certificate is not trusted without the CA")
}

// With client certificates verified (nats-config --tls-ca), kvactors
// presents its own (--nats-cert, --nats-key) beside the CA: the node
// starts on the embedded server loaded from the configuration, and an
// engine with a client certificate is served; one without is refused.
func TestEmbeddedNATSVerifyingClientCertificates(t *testing.T) {
	t.Parallel()
	certs := testkit.TLS(t)
	e, connect := securedNode(t, natsauth.Options{Engines: []string{"gpu0"}, TLSCert: certs.Cert, TLSKey: certs.Key,
		TLSCA: certs.CA}, func(c *node.Config) { c.NATSCA, c.NATSCert, c.NATSKey = certs.CA, certs.ClientCert, certs.ClientKey })
	e.nc = connect("gpu0", make(chan error, 8), nats.RootCAs(certs.CA), nats.ClientCert(certs.ClientCert, certs.ClientKey))
	te := e.newEngine("gpu0", defaultOpts())
	te.register()

	_, err := nats.Connect(e.node.NATSURL(), nats.RootCAs(certs.CA), nats.Timeout(2*time.Second))
	require.Error(t, err)
	require.NotErrorIs(t, err, nats.ErrAuthorization, "refused for its certificate, before credentials")
	t.Logf("no client certificate: %v", err)
}

// A configuration that verifies client certificates, loaded into the
// embedded server by a node given none of its own, is a config error at
// start (exit 2), naming the flags: its in-process connection's TLS
// handshake would fail, retried until the connect timeout.
func TestEmbeddedNATSVerifyingClientCertificatesNeedsTheNodesOwn(t *testing.T) {
	t.Parallel()
	certs := testkit.TLS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := node.Start(ctx, node.VerifyingNATSNode(t, certs))
	if err == nil {
		_ = n.Close(context.Background())
	}
	require.ErrorIs(t, err, node.ErrConfig)
	require.ErrorContains(t, err, "--nats-cert and --nats-key")
}

// A client certificate the embedded server does not accept (signed by
// another CA) is a config error at start naming --nats-cert (exit 2), not
// an in-process TLS handshake that deadlocked on its pipe past the start's
// context, until nats.go's minute-long write timeout ('write pipe: i/o
// timeout', exit 1).
func TestEmbeddedNATSRejectingTheNodesCertificateFailsStartInTime(t *testing.T) {
	t.Parallel()
	certs, other := testkit.TLS(t), testkit.TLS(t)
	const bound = 10 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	start := time.Now()
	cfg := node.VerifyingNATSNode(t, certs)
	cfg.NATSCert, cfg.NATSKey, cfg.NATSConnectTimeout = other.ClientCert, other.ClientKey, time.Minute
	n, err := node.Start(ctx, cfg)
	took := time.Since(start)
	if err == nil {
		_ = n.Close(context.Background())
	}
	t.Logf("took %v: %v", took, err)
	require.Less(t, took, bound, "refused before the in-process handshake, not a minute into it")
	require.ErrorIs(t, err, node.ErrConfig)
	require.ErrorContains(t, err, "--nats-cert "+other.ClientCert+" is refused")
}

// The node's in-process connection to its embedded TLS server checks the
// server certificate's chain against --nats-ca, not its name against the
// listen host (the pipe has no host): a node listening on every interface,
// or with a certificate for a DNS name only, starts; one given another CA
// does not.
func TestEmbeddedNATSOverTLSChecksTheChainNotTheListenHost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, host string
		names      []string
		otherCA    bool
	}{
		{name: "every interface", host: "0.0.0.0"},
		{name: "a DNS name only", host: "127.0.0.1", names: []string{"nats.example.com"}},
		{name: "another CA", host: "127.0.0.1", otherCA: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			certs := testkit.TLS(t, tc.names...)
			cfg := node.VerifyingNATSNode(t, certs)
			cfg.NATSCert, cfg.NATSKey, cfg.NATSHost = certs.ClientCert, certs.ClientKey, tc.host
			cfg.NATSConnectTimeout = 3 * time.Second
			if tc.otherCA {
				cfg.NATSCA = testkit.TLS(t).CA
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			n, err := node.Start(ctx, cfg)
			if err == nil {
				_ = n.Close(context.Background())
			}
			if tc.otherCA {
				require.ErrorContains(t, err, "certificate signed by unknown authority")
				return
			}
			require.NoError(t, err)
		})
	}
}
