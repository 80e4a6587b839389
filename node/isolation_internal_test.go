package node

import (
	"bytes"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/natsauth"
)

func TestBeyondLoopback(t *testing.T) {
	for host, want := range map[string]bool{
		"127.0.0.1": false, "::1": false, "localhost": false, "127.3.2.1": false,
		"0.0.0.0": true, "::": true, "": true, "10.1.2.3": true, "192.168.0.7": true,
	} {
		require.Equal(t, want, beyondLoopback(host), host)
	}
}

// A warning at start when the embedded NATS listens beyond loopback without
// auth, or the admin HTTP beyond loopback (it has no auth); none on
// loopback or with auth. Nothing listens here: the decision is on options.
func TestWarnExposure(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	authed := &server.Options{Host: "0.0.0.0", Nkeys: []*server.NkeyUser{{Nkey: "U"}}}
	for _, tc := range []struct {
		name string
		http string
		nats *server.Options
		want []string
	}{
		{"loopback", "127.0.0.1:9464", &server.Options{Host: "127.0.0.1"}, nil},
		{"nats everywhere, no auth", "127.0.0.1:9464", &server.Options{Host: "0.0.0.0"},
			[]string{"embedded NATS listens beyond loopback without auth"}},
		{"nats everywhere with auth", "127.0.0.1:9464", authed, nil},
		{"external nats", "127.0.0.1:9464", nil, nil},
		{"admin everywhere", ":9464", authed, []string{"admin HTTP listens beyond loopback"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			n := &Node{cfg: Config{HTTPAddr: tc.http}, log: slog.New(slog.NewTextHandler(&buf, nil)), ln: ln}
			n.warnExposure(tc.nats)
			for _, w := range tc.want {
				require.Contains(t, buf.String(), w)
			}
			if tc.want == nil {
				require.Empty(t, buf.String())
			}
		})
	}
}

// --nats-config: the file's auth, permissions and JetStream choice reach the
// embedded server; the flags fill in the listen address the file leaves
// out; without a file JetStream is off.
func TestEmbeddedOptions(t *testing.T) {
	plain, err := Config{NATSHost: "127.0.0.1", NATSPort: -1}.embeddedOptions()
	require.NoError(t, err)
	require.False(t, plain.JetStream, "JetStream is off by default")
	require.False(t, hasAuth(plain))

	g, err := natsauth.Generate(natsauth.Options{Engines: []string{"e1"}, JetStream: true})
	require.NoError(t, err)
	p := filepath.Join(t.TempDir(), "n.conf")
	require.NoError(t, os.WriteFile(p, []byte(g.Config+"\nport: 4333\n"), 0o600))
	o, err := Config{NATSHost: "127.0.0.1", NATSPort: -1, NATSConfig: p}.embeddedOptions()
	require.NoError(t, err)
	require.True(t, o.JetStream)
	require.True(t, hasAuth(o))
	require.Equal(t, 4333, o.Port, "the file's port wins")
	require.Equal(t, "127.0.0.1", o.Host, "the flag fills what the file leaves out")

	// A clustered node's embedded JetStream syncs every write (revisions
	// fence owners: docs/CLUSTER.md "Durability"), unless a file says how.
	cl, err := Config{NATSHost: "127.0.0.1", NATSPort: -1, Cluster: true}.embeddedOptions()
	require.NoError(t, err)
	require.True(t, cl.JetStream)
	require.True(t, cl.SyncAlways)
	own := filepath.Join(t.TempDir(), "sync.conf")
	require.NoError(t, os.WriteFile(own, []byte("jetstream {\n  sync_interval: 30s\n}\n"), 0o600))
	cl, err = Config{NATSHost: "127.0.0.1", NATSPort: -1, Cluster: true, NATSConfig: own}.embeddedOptions()
	require.NoError(t, err)
	require.False(t, cl.SyncAlways, "the file's choice stands")
	require.Equal(t, 30*time.Second, cl.SyncInterval)

	_, err = Config{NATSConfig: filepath.Join(t.TempDir(), "missing.conf")}.embeddedOptions()
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, Config{NATSConfig: p, NATSURL: "nats://x"}.Validate(), "embedded server")
}

// The isolation bounds: 0 takes the default, negative is a config error.
func TestIsolationBoundsConfig(t *testing.T) {
	c := Config{}.withDefaults()
	require.Equal(t, DefaultConfig().MaxEngines, c.MaxEngines)
	require.Equal(t, DefaultConfig().MaxRequests, c.MaxRequests)
	require.Equal(t, DefaultConfig().MaxMappedSegments, c.MaxMappedSegments)
	require.Equal(t, DefaultConfig().MaxMappedBytes, c.MaxMappedBytes)
	require.Equal(t, DefaultConfig().MaxModelLen, c.MaxModelLen)
	require.NoError(t, Config{}.Validate())
	for _, bad := range []Config{{MaxEngines: -1}, {MaxRequests: -1}, {MaxMappedSegments: -1}, {MaxMappedBytes: -1},
		{MaxModelLen: -1}} {
		require.ErrorIs(t, bad.Validate(), ErrConfig)
	}
}

// The load wait: 0 takes the default (2 s), a wait past lease/2 is cut to
// it (a short test lease keeps the default valid), negative is an error.
func TestLoadWaitConfig(t *testing.T) {
	require.Equal(t, 2*time.Second, Config{}.withDefaults().LoadWait)
	require.Equal(t, 500*time.Millisecond, Config{Lease: time.Second}.withDefaults().LoadWait)
	require.Equal(t, 100*time.Millisecond, Config{LoadWait: 100 * time.Millisecond}.withDefaults().LoadWait)
	require.NoError(t, Config{Lease: time.Second, LoadWait: 5 * time.Second}.Validate())
	require.ErrorIs(t, Config{LoadWait: -time.Second}.Validate(), ErrConfig)
}
