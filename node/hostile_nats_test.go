package node_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// securedNode starts a node whose embedded server loads the configuration
// `kvactors nats-config` generates for engines (the node authenticates as
// kvactors' user), and returns a connect function that logs a client in as
// one of them, with its inbox prefix, reporting its async errors on errs.
func securedNode(t *testing.T, o natsauth.Options, mutate ...func(*node.Config)) (*env,
	func(id string, errs chan<- error, opts ...nats.Option) *nats.Conn) {
	t.Helper()
	e, connect, _ := securedNodeCreds(t, o, mutate...)
	return e, connect
}

// securedNodeCreds is securedNode that also returns the directory of the
// users' secret files.
func securedNodeCreds(t *testing.T, o natsauth.Options, mutate ...func(*node.Config)) (*env,
	func(id string, errs chan<- error, opts ...nats.Option) *nats.Conn, string) {
	t.Helper()
	g, err := natsauth.Generate(o)
	require.NoError(t, err)
	creds := filepath.Join(t.TempDir(), "creds")
	_, err = g.Write(creds)
	require.NoError(t, err)
	dir := t.TempDir()
	reg := prometheus.NewRegistry()
	cfg := node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir,
		PoolBytes: 1 << 20, HTTPAddr: "127.0.0.1:0", Registry: reg, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		NATSConfig: filepath.Join(creds, natsauth.ConfigFile)}
	password := func(id string) string {
		b, err := os.ReadFile(filepath.Join(creds, id+".password"))
		require.NoError(t, err)
		return strings.TrimSpace(string(b))
	}
	if o.Auth == natsauth.AuthPassword {
		cfg.NATSUser, cfg.NATSPassword = natsauth.ServiceUser, password(natsauth.ServiceUser)
	} else {
		cfg.NATSNKey = filepath.Join(creds, natsauth.ServiceUser+".nk")
	}
	for _, m := range mutate {
		m(&cfg)
	}
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	connect := func(id string, errs chan<- error, opts ...nats.Option) *nats.Conn {
		t.Helper()
		var auth nats.Option
		if o.Auth == natsauth.AuthPassword {
			auth = nats.UserInfo(id, password(id))
		} else {
			var err error
			auth, err = nats.NkeyOptionFromSeed(filepath.Join(creds, id+".nk"))
			require.NoError(t, err)
		}
		nc, err := nats.Connect(n.NATSURL(), append([]nats.Option{auth, nats.CustomInboxPrefix(natsauth.InboxPrefix(id)),
			nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
				select {
				case errs <- err:
				default: // the test reads what it expects; more is not its business
				}
			})}, opts...)...)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		return nc
	}
	return &env{t: t, node: n, reg: reg, dir: dir}, connect, creds
}

// violation waits for the async permission error about subject.
func violation(t *testing.T, errs <-chan error, subject string) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case err := <-errs:
			if errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), `"`+subject+`"`) {
				return
			}
		case <-deadline:
			t.Fatalf("no permissions violation reported for %s", subject)
		}
	}
}

// The permission attacks of issue 11 against a node and a nats-server
// configured by `kvactors nats-config`: publishing finished on the victim's
// subject, registering under its name, answering P.vic.lookup, reading its
// reply inboxes, subscribing to the verbs kvactors serves, asking for its
// status. NATS refuses each with a permissions violation; the victim's
// requests, bytes and lookups are untouched and a well-behaved engine is
// served throughout.
func TestHostileNATSPermissions(t *testing.T) {
	t.Parallel()
	for _, auth := range []string{natsauth.AuthNKey, natsauth.AuthPassword} {
		t.Run(auth, func(t *testing.T) { hostileNATSPermissions(t, auth) })
	}
}

func hostileNATSPermissions(t *testing.T, auth string) {
	base, connect := securedNode(t, natsauth.Options{Engines: []string{"vic", "mal", "good"}, Auth: auth,
		BcryptCost: bcrypt.MinCost}) // the server checks a hash per connect; -race makes the default cost slow
	vicEnv, malEnv, goodEnv := *base, *base, *base
	vicErrs, malErrs := make(chan error, 64), make(chan error, 64)
	vicEnv.nc = connect("vic", vicErrs)
	malEnv.nc = connect("mal", malErrs)
	goodEnv.nc = connect("good", make(chan error, 64))
	vic, hs, want := victim(t, &vicEnv)
	mal := malEnv.newEngine("mal", defaultOpts())
	mal.register() // its own name is fine

	// Forged answers and eavesdropping: subscriptions refused.
	var forged atomic.Int32
	for _, subj := range []string{"kvactors.vic.lookup", "_INBOX.vic.>", "kvactors.*.register", "kvactors._node.>",
		"kvactors.vic.released"} {
		_, err := malEnv.nc.Subscribe(subj, func(m *nats.Msg) {
			forged.Add(1)
			_ = m.Respond([]byte(`{"hit_tokens":9999}`))
		})
		require.NoError(t, err)
		require.NoError(t, malEnv.nc.Flush())
		violation(t, malErrs, subj)
	}

	// Acting as the victim: publishes refused.
	fin, _ := json.Marshal(map[string]any{"epoch": "ep1", "seq": 2, "events": []any{finishedEv("r", true, 0, 16)}})
	require.NoError(t, malEnv.nc.Publish("kvactors.vic.events", fin))
	require.NoError(t, malEnv.nc.Flush())
	violation(t, malErrs, "kvactors.vic.events")
	spec, _ := json.Marshal(mal.spec)
	_, err := malEnv.nc.Request("kvactors.vic.register", spec, 500*time.Millisecond)
	require.Error(t, err, "no reply to a refused request")
	violation(t, malErrs, "kvactors.vic.register")
	_, err = malEnv.nc.Request("kvactors.vic.status", []byte(`{}`), 500*time.Millisecond)
	require.Error(t, err)
	violation(t, malErrs, "kvactors.vic.status")
	require.NoError(t, malEnv.nc.Publish("$JS.API.STREAM.CREATE.fill", []byte(`{"name":"fill"}`)))
	require.NoError(t, malEnv.nc.Flush())
	violation(t, malErrs, "$JS.API.STREAM.CREATE.fill")

	// Forging what kvactors publishes on its own subjects: other nodes and
	// routers read P.<engine>.kv_events as a node's account of its pool, in
	// any namespace, so an engine may not publish there, nor its other
	// node-only verbs (the server refuses each: nobody receives it).
	forgedKV := []byte(`{"ts":1,"events":[{"type":"BlockStored","namespace":"vic","block_hashes":["abcd"],"medium":"CPU"}]}`)
	for _, verb := range natsauth.NodeOnlyVerbs {
		subj := "kvactors.mal." + verb
		require.NoError(t, malEnv.nc.Publish(subj, forgedKV))
		require.NoError(t, malEnv.nc.Flush())
		violation(t, malErrs, subj)
	}

	// The victim: request r still live (not released by the forged
	// finished), lookups answered by the node only, bytes intact.
	none(vic, vic.released, "a release forged by the attacker")
	st := vic.sync()
	require.Len(t, st.Requests, 1)
	require.Equal(t, "r", st.Requests[0].Request)
	intact(t, vic, hs, want)
	require.Zero(t, forged.Load(), "the attacker's handlers never ran")
	select {
	case err := <-vicErrs:
		t.Fatalf("the victim hit a permission error: %v", err)
	default:
	}

	// A well-behaved engine is served, end to end.
	goodEngineIsServed(t, &goodEnv)
}

// With JetStream turned on in the generated configuration, only kvactors'
// user may use its API: an engine cannot create a stream.
func TestHostileJetStreamRestricted(t *testing.T) {
	t.Parallel()
	_, connect := securedNode(t, natsauth.Options{Engines: []string{"mal"}, JetStream: true})
	errs := make(chan error, 64)
	nc := connect("mal", errs)
	js, err := nc.JetStream(nats.MaxWait(500 * time.Millisecond))
	require.NoError(t, err)
	_, err = js.AddStream(&nats.StreamConfig{Name: "fill", Subjects: []string{"fill.>"}})
	require.Error(t, err)
	violation(t, errs, "$JS.API.STREAM.CREATE.fill")

	svc := connect(natsauth.ServiceUser, make(chan error, 64))
	sjs, err := svc.JetStream(nats.MaxWait(5 * time.Second))
	require.NoError(t, err)
	_, err = sjs.AddStream(&nats.StreamConfig{Name: "kv", Subjects: []string{"kvactors.x.events"}})
	require.NoError(t, err, "kvactors' own user may")
	kv, err := sjs.CreateKeyValue(&nats.KeyValueConfig{Bucket: "owners"})
	require.NoError(t, err, "kvactors' own user may keep a KV bucket (cluster ownership)")
	_, err = kv.Put("e1", []byte("node-a"))
	require.NoError(t, err)
	require.NoError(t, nc.Publish("$KV.owners.e1", []byte("forged")))
	require.NoError(t, nc.Flush())
	violation(t, errs, "$KV.owners.e1")
	got, err := kv.Get("e1")
	require.NoError(t, err)
	require.Equal(t, "node-a", string(got.Value()), "an engine cannot forge an ownership record")
}

// Attack: a reply subject with a wildcard token. The server delivers what
// is published on `_INBOX.vic.>` to every subscription matching it as a
// literal, so the victim's own wildcard subscription on its inboxes (the
// one its permissions allow) received the attacker's status answers, which
// the attacker itself may not publish there. The node answers only on a
// literal reply subject: refused `bad_reply`, nothing delivered.
func TestHostileWildcardReplySubjectIsRefused(t *testing.T) {
	t.Parallel()
	base, connect := securedNode(t, natsauth.Options{Engines: []string{"vic", "mal"}})
	vicEnv, malEnv := *base, *base
	vicEnv.nc = connect("vic", make(chan error, 64))
	malEnv.nc = connect("mal", make(chan error, 64))
	inbox := make(chan *nats.Msg, 16)
	_, err := vicEnv.nc.ChanSubscribe("_INBOX.vic.>", inbox)
	require.NoError(t, err)
	require.NoError(t, vicEnv.nc.Flush())
	mal := malEnv.newEngine("mal", defaultOpts())
	mal.register()
	before := rejected(t, base, messages.RejectBadReply)
	forged := []struct{ verb, reply, body string }{
		{"status", "_INBOX.vic.>", `{}`},
		{"status", "_INBOX.vic.*", `{}`},
		{"status", "_INBOX.*.x", `{}`},
		{"status", "_INBOX.>", `{}`},
		{"lookup", "_INBOX.mal.>", `{"hashes":[]}`},
		{"lookup", "_INBOX.mal.*.x", `{"hashes":[]}`},
	}
	for _, f := range forged {
		require.NoError(t, malEnv.nc.PublishRequest("kvactors.mal."+f.verb, f.reply, []byte(f.body)))
	}
	// Taken after them on the node's one subscription: once it is answered,
	// every forged message has been refused or answered.
	reply := mal.request("lookup", map[string]any{"hashes": []string{}})
	require.Contains(t, string(reply), `"hit_tokens":0`)
	// Refused in the intake, before anything is queued: counted by now.
	require.Equal(t, before+float64(len(forged)), rejected(t, base, messages.RejectBadReply), "each refusal counted")
	require.NoError(t, vicEnv.nc.Flush())
	select {
	case m := <-inbox:
		t.Fatalf("the node answered mal in the victim's inboxes, on %s: %s", m.Subject, m.Data)
	default:
	}
}

// The bounds nats-config writes: an engine subscribing past
// max_subscriptions on one connection is refused (the connection stays),
// and one opening connections past max_connections is refused at connect;
// an honest engine connected before is served throughout (docs/SECURITY.md
// "Bounds").
func TestHostileNATSConnectionsAndSubscriptionsBounded(t *testing.T) {
	t.Parallel()
	const maxConns, maxSubs = 8, 32
	base, connect, creds := securedNodeCreds(t, natsauth.Options{Engines: []string{"mal", "good"},
		MaxConnections: maxConns, MaxSubscriptions: maxSubs})
	malEnv, goodEnv := *base, *base
	goodEnv.nc = connect("good", make(chan error, 64))
	malErrs := make(chan error, 64)
	malEnv.nc = connect("mal", malErrs)

	subs := 0
	for ; subs < 4*maxSubs; subs++ {
		_, err := malEnv.nc.Subscribe(fmt.Sprintf("_INBOX.mal.%d", subs), func(*nats.Msg) {})
		require.NoError(t, err) // refused by the server, asynchronously
	}
	require.NoError(t, malEnv.nc.Flush(), "the connection stays")
	deadline := time.After(5 * time.Second)
	for refused := false; !refused; {
		select {
		case err := <-malErrs:
			refused = errors.Is(err, nats.ErrMaxSubscriptionsExceeded)
		case <-deadline:
			t.Fatalf("%d subscriptions on one connection, none refused", subs)
		}
	}

	// The node's own connection, good's and mal's are three.
	var extra []*nats.Conn
	t.Cleanup(func() {
		for _, nc := range extra {
			nc.Close()
		}
	})
	auth, err := nats.NkeyOptionFromSeed(filepath.Join(creds, "mal.nk"))
	require.NoError(t, err)
	for len(extra) < 4*maxConns {
		var nc *nats.Conn
		if nc, err = nats.Connect(base.node.NATSURL(), auth); err != nil {
			break
		}
		extra = append(extra, nc)
	}
	require.Error(t, err, "%d connections, none refused", len(extra)+3)
	t.Logf("connection %d refused: %v", len(extra)+4, err)
	require.LessOrEqual(t, len(extra)+3, maxConns)

	goodEngineIsServed(t, &goodEnv)
}

// goodEngineIsServed registers the well-behaved engine "good" on e and
// checks it is served end to end: a chunk stored, then found by a lookup.
func goodEngineIsServed(t *testing.T, e *env) {
	t.Helper()
	good := e.newEngine("good", defaultOpts())
	good.register()
	good.fill(0, 7, 3)
	good.send(added("g", 4), hashesEv("g", 0, hash("g", 0)), blocksEv("g", 0, 0, 7), tokensEv("g", 4, 4))
	recv(t, good.stored, "good engine's store")
	require.Equal(t, 4, good.lookup([]string{hash("g", 0)}))
}
