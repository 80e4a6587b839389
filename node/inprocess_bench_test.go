package node

import (
	"crypto/tls"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// BenchmarkInProcessMessages is what TLS cost the node's in-process
// connection to an embedded server configured with TLS, before
// plainInProcess: 512-byte messages from one in-process connection to
// another through a server whose listener has TLS, both connections plain
// (as the node's now) or both over TLS (as before).
func BenchmarkInProcessMessages(b *testing.B) {
	certs := testkit.TLS(b)
	for _, mode := range []string{"plain", "tls"} {
		b.Run(mode, func(b *testing.B) {
			s := testkit.NATSServerWith(b, func(o *server.Options) {
				tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: certs.Cert, KeyFile: certs.Key})
				require.NoError(b, err)
				o.TLSConfig, o.TLS = tc, true
			})
			conn := func() *nats.Conn {
				opts := []nats.Option{nats.InProcessServer(s)}
				if mode == "tls" {
					opts = append(opts, nats.RootCAs(certs.CA), nats.Secure(&tls.Config{ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}))
				} else {
					opts = append(opts, plainInProcess)
				}
				nc, err := nats.Connect("nats://"+s.Addr().String(), opts...)
				require.NoError(b, err)
				b.Cleanup(nc.Close)
				return nc
			}
			pub, sub := conn(), conn()
			var got atomic.Int64
			done := make(chan struct{})
			subscription, err := sub.Subscribe("bench", func(*nats.Msg) {
				if got.Add(1) == int64(b.N) {
					close(done)
				}
			})
			require.NoError(b, err)
			require.NoError(b, subscription.SetPendingLimits(-1, -1)) // a slow consumer would drop some: never done
			require.NoError(b, sub.Flush())
			msg := make([]byte, 512)
			b.SetBytes(int64(len(msg)))
			b.ResetTimer()
			for range b.N {
				if err := pub.Publish("bench", msg); err != nil {
					b.Fatal(err)
				}
			}
			select {
			case <-done:
			case <-time.After(time.Minute):
				b.Fatalf("%d of %d messages received", got.Load(), b.N)
			}
		})
	}
}
