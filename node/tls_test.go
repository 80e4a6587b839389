package node_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// writeCert writes a CA and a server certificate for 127.0.0.1 signed by it;
// it returns the CA, certificate and key files.
func writeCert(t *testing.T) (ca, cert, key string) {
	t.Helper()
	dir := t.TempDir()
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600))
		return p
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvactors test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	srvTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caTmpl, &srvKey.PublicKey, caKey)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(srvKey)
	require.NoError(t, err)
	return write("ca.pem", "CERTIFICATE", caDER), write("server.pem", "CERTIFICATE", srvDER),
		write("server-key.pem", "EC PRIVATE KEY", keyDER)
}

// The deployment recipe of docs/SECURITY.md: the embedded server loads a
// generated configuration with TLS and per-engine nkeys; kvactors connects
// over TLS as its own user (--nats-ca, --nats-nkey); an engine that trusts
// the CA is served; a client that does not trust it, or has no credentials,
// is not let in.
func TestEmbeddedNATSWithAuthAndTLS(t *testing.T) {
	t.Parallel()
	ca, cert, key := writeCert(t)
	e, connect := securedNode(t, natsauth.Options{Engines: []string{"gpu0"}, TLSCert: cert, TLSKey: key},
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
