package natsauth

import (
	"testing"

	"github.com/nats-io/nats-server/v2/conf"
	"github.com/stretchr/testify/require"
)

// FuzzGenerateRoundTrips: options Generate accepts give a configuration
// nats-server's parser reads back exactly, the prefix in every permission and
// the TLS paths byte for byte; options it refuses are refused with
// ErrOptions. A prefix or a path the parser cannot read back would be a
// config the server refuses to start with, or one that grants another
// subject than the one asked for.
func FuzzGenerateRoundTrips(f *testing.F) {
	f.Add("kvactors", "e1", "/etc/kv/cert.pem", "")
	f.Add("kv.prod", "engine-7", `C:\certs\"a".pem`, "ca.pem")
	f.Add("kv\u00e9", "e_1", "cert\xff.pem", "ca\t.pem")
	f.Fuzz(func(t *testing.T, prefix, id, cert, ca string) {
		g, err := Generate(Options{Prefix: prefix, Engines: []string{id}, TLSCert: cert, TLSKey: "key.pem", TLSCA: ca})
		if err != nil {
			require.ErrorIs(t, err, ErrOptions)
			return
		}
		m, err := conf.Parse(g.Config)
		require.NoError(t, err, "nats-server cannot parse what Generate wrote:\n%s", g.Config)
		if cert != "" {
			tls, _ := m["tls"].(map[string]any)
			require.Equal(t, cert, tls["cert_file"])
			if ca != "" {
				require.Equal(t, ca, tls["ca_file"])
			}
		}
		users := m["authorization"].(map[string]any)["users"].([]any)
		require.Len(t, users, 2)
		perms := users[1].(map[string]any)["permissions"].(map[string]any)
		pub := perms["publish"].(map[string]any)["allow"].([]any)
		if prefix == "" {
			prefix = "kvactors" // the default
		}
		require.Equal(t, []any{prefix + "." + id + ".>"}, pub)
	})
}
