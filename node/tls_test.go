package node_test

import (
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
// as its own user (--nats-nkey; in-process, so without TLS: a --nats-ca
// changes nothing); an engine that trusts
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

// With client certificates verified (nats-config --tls-ca), the node
// starts on the embedded server loaded from the configuration with no
// certificate of its own (its connection is in-process, plain: no
// --nats-cert, no --nats-ca); an engine with a client certificate is
// served, one without is refused.
func TestEmbeddedNATSVerifyingClientCertificates(t *testing.T) {
	t.Parallel()
	certs := testkit.TLS(t)
	e, connect := securedNode(t, natsauth.Options{Engines: []string{"gpu0"}, TLSCert: certs.Cert, TLSKey: certs.Key,
		TLSCA: certs.CA})
	e.nc = connect("gpu0", make(chan error, 8), nats.RootCAs(certs.CA), nats.ClientCert(certs.ClientCert, certs.ClientKey))
	te := e.newEngine("gpu0", defaultOpts())
	te.register()

	_, err := nats.Connect(e.node.NATSURL(), nats.RootCAs(certs.CA), nats.Timeout(2*time.Second))
	require.Error(t, err)
	require.NotErrorIs(t, err, nats.ErrAuthorization, "refused for its certificate, before credentials")
	t.Logf("no client certificate: %v", err)
}
