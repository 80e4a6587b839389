package natsauth

import (
	"cmp"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"
)

// The generated file is a configuration nats-server accepts, with one user
// per engine and the permissions of docs/SECURITY.md, for both auth kinds.
func TestGenerateParses(t *testing.T) {
	for _, auth := range []string{AuthNKey, AuthPassword} {
		t.Run(auth, func(t *testing.T) {
			g, err := Generate(Options{Prefix: "kv", Engines: []string{"e1", "e2"}, Routers: []string{"r1"}, Auth: auth,
				BcryptCost: bcrypt.MinCost})
			require.NoError(t, err)
			require.Len(t, g.Creds, 4)
			dir := t.TempDir()
			paths, err := g.Write(filepath.Join(dir, "out"))
			require.NoError(t, err)
			require.Len(t, paths, 5)
			for _, p := range paths {
				st, err := os.Stat(p)
				require.NoError(t, err)
				require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), p)
			}
			_, err = g.Write(filepath.Join(dir, "out"))
			require.Error(t, err, "never overwrites secrets")

			opts, err := server.ProcessConfigFile(filepath.Join(dir, "out", ConfigFile))
			require.NoError(t, err)
			require.False(t, opts.JetStream, "JetStream is off unless asked for")
			perms := map[string]*server.Permissions{}
			switch auth {
			case AuthNKey:
				require.Len(t, opts.Nkeys, 4)
				for i, u := range opts.Nkeys {
					perms[g.Creds[i].User] = u.Permissions
					require.True(t, strings.HasPrefix(u.Nkey, "U"))
					require.True(t, strings.HasPrefix(g.Creds[i].Seed, "SU"))
				}
			case AuthPassword:
				require.Len(t, opts.Users, 4)
				for _, u := range opts.Users {
					perms[u.Username] = u.Permissions
					require.True(t, strings.HasPrefix(u.Password, "$2a$"), "the config holds hashes only")
				}
			}
			e1 := perms["e1"]
			require.Equal(t, []string{"kv.e1.>"}, e1.Publish.Allow)
			require.Equal(t, []string{"kv.e1.released", "kv.e1.stored", "kv.e1.kv_events", "kv.e1.resync"}, e1.Publish.Deny,
				"an engine cannot publish what kvactors publishes on its subjects")
			require.Equal(t, []string{"kv.e1.>", "kv._node.*.hello", "kv._node.*.heartbeat", "_INBOX.e1.>"}, e1.Subscribe.Allow)
			require.Nil(t, e1.Response, "an engine answers nobody's requests")
			svc := perms[ServiceUser]
			require.Equal(t, []string{"kv.>"}, svc.Publish.Allow)
			require.Contains(t, svc.Subscribe.Allow, "kv.*.*", "kvactors reads every engine verb through one subscription")
			require.Contains(t, svc.Subscribe.Allow, "kv._node.>")
			require.NotNil(t, svc.Response, "kvactors publishes replies")
			require.Equal(t, []string{"kv.*.status"}, perms["r1"].Publish.Allow)
		})
	}
}

// With JetStream on, only kvactors' user may publish to its API, and the
// server syncs every write.
func TestGenerateJetStream(t *testing.T) {
	g, err := Generate(Options{Engines: []string{"e1"}, JetStream: true})
	require.NoError(t, err)
	p := filepath.Join(t.TempDir(), "c.conf")
	require.NoError(t, os.WriteFile(p, []byte(g.Config), 0o600))
	opts, err := server.ProcessConfigFile(p)
	require.NoError(t, err)
	require.True(t, opts.JetStream)
	require.True(t, opts.SyncAlways, "every write synced: revisions fence the owners")
	require.Contains(t, opts.Nkeys[0].Permissions.Publish.Allow, "$JS.API.>")
	require.NotContains(t, opts.Nkeys[1].Permissions.Publish.Allow, "$JS.API.>")
}

// The server's bounds on connections and each connection's subscriptions
// are written, the defaults or the options', and the server reads them.
func TestGenerateBounds(t *testing.T) {
	for _, o := range []Options{{Engines: []string{"e1"}},
		{Engines: []string{"e1"}, MaxConnections: 7, MaxSubscriptions: 9}} {
		g, err := Generate(o)
		require.NoError(t, err)
		p := filepath.Join(t.TempDir(), "c.conf")
		require.NoError(t, os.WriteFile(p, []byte(g.Config), 0o600))
		opts, err := server.ProcessConfigFile(p)
		require.NoError(t, err)
		conns, subs := cmp.Or(o.MaxConnections, DefaultMaxConnections), cmp.Or(o.MaxSubscriptions, DefaultMaxSubscriptions)
		require.Equal(t, conns, opts.MaxConn)
		require.Equal(t, subs, opts.MaxSubs)
	}
}

func TestGenerateRefuses(t *testing.T) {
	for name, o := range map[string]Options{
		"reserved id":       {Engines: []string{"_kvactors"}},
		"bad id":            {Engines: []string{"a.b"}},
		"wildcard id":       {Engines: []string{"*"}},
		"duplicate":         {Engines: []string{"e1"}, Routers: []string{"e1"}},
		"unknown auth":      {Engines: []string{"e1"}, Auth: "token"},
		"wildcard prefix":   {Engines: []string{"e1"}, Prefix: "kv.>"},
		"inbox prefix":      {Engines: []string{"e1"}, Prefix: "_INBOX"},
		"system prefix":     {Engines: []string{"e1"}, Prefix: "$KV.x"},
		"empty token":       {Engines: []string{"e1"}, Prefix: "a..b"},
		"trailing dot":      {Engines: []string{"e1"}, Prefix: "kv."},
		"control char":      {Engines: []string{"e1"}, Prefix: "kv\x01"},
		"cert without key":  {Engines: []string{"e1"}, TLSCert: "c.pem"},
		"bcrypt cost":       {Engines: []string{"e1"}, Auth: AuthPassword, BcryptCost: 99},
		"max connections":   {Engines: []string{"e1"}, MaxConnections: -1},
		"max subscriptions": {Engines: []string{"e1"}, MaxSubscriptions: -1},
	} {
		_, err := Generate(o)
		require.ErrorIs(t, err, ErrOptions, name)
	}
}
