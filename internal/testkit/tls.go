package testkit

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

	"github.com/stretchr/testify/require"
)

// TLSFiles are the PEM files TLS writes.
type TLSFiles struct {
	CA                    string // the CA that signed both certificates
	Cert, Key             string // a server certificate for 127.0.0.1 (or the names given)
	ClientCert, ClientKey string // a client certificate
}

// TLS writes a CA, a server certificate for 127.0.0.1 and a client
// certificate, both signed by it, into a temporary directory. serverNames,
// when given, are the server certificate's names instead (an IP address or
// a DNS name each).
func TLS(t testing.TB, serverNames ...string) TLSFiles {
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
	signed := func(serial int64, name string, usage x509.ExtKeyUsage) (cert, key string) {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
		if usage == x509.ExtKeyUsageServerAuth {
			if len(serverNames) == 0 {
				serverNames = []string{"127.0.0.1"}
			}
			for _, n := range serverNames {
				if ip := net.ParseIP(n); ip != nil {
					tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
				} else {
					tmpl.DNSNames = append(tmpl.DNSNames, n)
				}
			}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caTmpl, &k.PublicKey, caKey)
		require.NoError(t, err)
		keyDER, err := x509.MarshalECPrivateKey(k)
		require.NoError(t, err)
		return write(name+".pem", "CERTIFICATE", der), write(name+"-key.pem", "EC PRIVATE KEY", keyDER)
	}
	f := TLSFiles{CA: write("ca.pem", "CERTIFICATE", caDER)}
	f.Cert, f.Key = signed(2, "server", x509.ExtKeyUsageServerAuth)
	f.ClientCert, f.ClientKey = signed(3, "client", x509.ExtKeyUsageClientAuth)
	return f
}
