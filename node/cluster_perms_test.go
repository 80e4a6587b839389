package node_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// securedCluster is a nats-server running the configuration `kvactors
// nats-config --jetstream` generates, and clustered nodes logged in to it as
// kvactors' user. One server, not a routed three: what is tested is what
// each user may do, which the routes do not change (permissions are checked
// by the server a client is connected to), and a routed cluster with auth
// would only add its own route credentials and seconds of start-up.
type securedCluster struct {
	t     *testing.T
	url   string
	creds string // the directory natsauth.Generated.Write filled
	dir   string // the shm directory every node and engine shares
	nodes []*env
}

// securedLease is the nodes' lease: short enough that nodes hear each
// other's heartbeats (every lease/4) quickly, long enough that the engines,
// which the test keeps alive by registering again between its phases, do
// not lapse while the refused requests wait out their timeouts.
const securedLease = 6 * time.Second

func startSecuredCluster(t *testing.T, engines []string, nodes int) *securedCluster {
	t.Helper()
	g, err := natsauth.Generate(natsauth.Options{Engines: engines, JetStream: true})
	require.NoError(t, err)
	sc := &securedCluster{t: t, creds: filepath.Join(t.TempDir(), "creds"), dir: t.TempDir()}
	_, err = g.Write(sc.creds)
	require.NoError(t, err)
	// The file as generated; the test only pins the listener to loopback
	// and a random port, and the store to a temp dir.
	opts, err := server.ProcessConfigFile(filepath.Join(sc.creds, natsauth.ConfigFile))
	require.NoError(t, err)
	require.True(t, opts.JetStream, "--jetstream turns JetStream on")
	opts.Host, opts.Port, opts.StoreDir, opts.NoLog, opts.NoSigs = "127.0.0.1", server.RANDOM_PORT, t.TempDir(), true, true
	s, err := server.NewServer(opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second), "nats-server ready")
	sc.url = s.ClientURL()

	for i := range nodes {
		reg := prometheus.NewRegistry()
		cfg := node.Config{NATSURL: sc.url, NATSNKey: filepath.Join(sc.creds, natsauth.ServiceUser+".nk"),
			NodeID: fmt.Sprintf("n%d", i), Cluster: true, ClusterReplicas: 1, Lease: securedLease,
			FetchTimeout: time.Second, ShmDir: sc.dir, PoolBytes: 1 << 20, HTTPAddr: "127.0.0.1:0",
			Registry: reg, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
		n, err := node.Start(context.Background(), cfg)
		require.NoError(t, err, "start node n%d as kvactors' user", i)
		t.Cleanup(func() { _ = n.Close(context.Background()) })
		sc.nodes = append(sc.nodes, &env{t: t, node: n, reg: reg, dir: sc.dir})
	}
	kc := &kvCluster{t: t, nodes: sc.nodes}
	kc.waitSeen() // hellos and heartbeats crossed under the permissions
	return sc
}

// connect logs a client in as user id with its nkey seed and inbox prefix;
// its async errors (permission violations) go to errs.
func (sc *securedCluster) connect(id string, errs chan error) *nats.Conn {
	t := sc.t
	t.Helper()
	seed, err := nats.NkeyOptionFromSeed(filepath.Join(sc.creds, id+".nk"))
	require.NoError(t, err)
	nc, err := nats.Connect(sc.url, seed, nats.CustomInboxPrefix(natsauth.InboxPrefix(id)),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			select {
			case errs <- err:
			default: // violation reads what it expects; more is not its business
			}
		}))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// engine is engine id on node i's env, over its own credentials.
func (sc *securedCluster) engine(i int, id string, errs chan error) *testEngine {
	e := *sc.nodes[i]
	e.nc = sc.connect(id, errs)
	return e.newEngine(id, defaultOpts())
}

// A clustered deployment under the configuration `kvactors nats-config
// --jetstream` generates (docs/SECURITY.md "Clusters"): three nodes log in
// as kvactors' user and claim engines in the ownership bucket, serve the
// key-set catch-up and remote fetch to each other over P._node.>, and a
// prefix stored through n0 loads byte-identically through n1. An engine's
// credentials cannot use any of it: requests to P._node.<node>.fetch and
// .keys, subscriptions to P._node.>, the JetStream API and the bucket's own
// subjects are each refused by NATS with a permissions violation, the
// ownership records are unchanged, and the nodes keep serving.
func TestClusterUnderGeneratedNATSPermissions(t *testing.T) {
	t.Parallel()
	sc := startSecuredCluster(t, []string{"ea", "eb", "ef", "mal"}, 3)
	noErrs := make(chan error, 64)
	a := sc.engine(0, "ea", noErrs)
	a.spec.Node, a.spec.Namespace = "n0", "m"
	a.register()
	b := sc.engine(1, "eb", noErrs)
	b.spec.Node, b.spec.Namespace = "n1", "m"
	b.register()

	// A register naming no node, seen by all three nodes: exactly one
	// answers (its claim won the compare-and-set) and serves the engine.
	f := sc.engine(0, "ef", noErrs)
	replies := collect(t, f.e.nc, "kvactors.ef.register", f.spec)
	var rr messages.RegisterReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "ef's register reply").Data, &rr))
	require.True(t, rr.OK, rr.Error)
	testkit.NoRecv(t, replies, 300*time.Millisecond, "a second register reply")
	owners := map[string][]string{}
	for _, e := range sc.nodes {
		for _, id := range e.node.Engines() {
			owners[id] = append(owners[id], e.node.NodeID())
		}
	}
	require.Equal(t, map[string][]string{"ea": {"n0"}, "eb": {"n1"}, "ef": {rr.Node}}, owners, "one owner per engine")

	// touch registers every well-behaved engine again: an identical spec is
	// a no-op and a sign of life, so no engine's session (nor its owner's
	// claim) lapses while the test takes its time.
	touch := func() {
		t.Helper()
		a.register()
		b.register()
		require.Contains(t, string(f.request("register", f.spec)), `"ok":true`)
	}

	// Stored through n0, counted and fetched by n1 (remote_chunks).
	hs := []string{hash("p", 0), hash("p", 1), hash("p", 2)}
	for i := range hs {
		a.fill(0, messages.BlockID(20+i), 5)
	}
	a.send(added("r", 12), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 20, 21, 22), tokensEv("r", 12, 12))
	recv(t, a.stored, "stored through n0")
	awaitLookup(t, b, hs, 12, "n1 of n0's prefix")
	r := b.loadInto("rb", hs, 12, []int{1, 2, 3})
	require.True(t, r.OK, r.Error)
	require.Equal(t, 3, r.RemoteChunks)
	for i := range hs {
		require.True(t, bytes.Equal(a.block(0, messages.BlockID(20+i)), b.block(0, messages.BlockID(1+i))),
			"block %d loaded through n1 equals the one stored through n0", i)
	}

	// What kvactors' user may do, as the control of every refusal below:
	// the same requests, answered.
	svc := sc.connect(natsauth.ServiceUser, make(chan error, 64))
	keysSubj := messages.NodeSubject("kvactors", "n0", messages.NodeVerbKeys)
	fetchSubj := messages.NodeSubject("kvactors", "n0", messages.NodeVerbFetch)
	msg, err := svc.Request(keysSubj, []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	var keys struct {
		Keys []struct{ Namespace, Key string }
	}
	require.NoError(t, json.Unmarshal(msg.Data, &keys))
	require.NotEmpty(t, keys.Keys, "n0 lists its keys to kvactors' user")
	fetch, err := json.Marshal(map[string]any{"namespace": keys.Keys[0].Namespace, "key": keys.Keys[0].Key, "max": 1 << 16})
	require.NoError(t, err)
	msg, err = svc.Request(fetchSubj, fetch, 5*time.Second)
	require.NoError(t, err)
	require.Empty(t, msg.Header.Get("Kvactors-Error"))
	require.NotEmpty(t, msg.Data, "n0 serves a chunk to kvactors' user")
	sjs, err := jetstream.New(svc)
	require.NoError(t, err)
	bucket, err := sjs.KeyValue(context.Background(), "kvactors_owners")
	require.NoError(t, err)
	before, err := bucket.Get(context.Background(), "ea")
	require.NoError(t, err)

	// The engine "mal", with its own valid credentials. A refused request
	// gets no reply: each waits out refusedWait.
	touch()
	const refusedWait = 250 * time.Millisecond
	malErrs := make(chan error, 64)
	mal := sc.connect("mal", malErrs)
	for _, subj := range []string{"kvactors._node.>", fetchSubj, "$KV.kvactors_owners.>", "$JS.API.>"} {
		_, err := mal.Subscribe(subj, func(m *nats.Msg) { t.Errorf("mal received %s", m.Subject) })
		require.NoError(t, err)
		require.NoError(t, mal.Flush())
		violation(t, malErrs, subj)
	}
	for subj, body := range map[string][]byte{keysSubj: []byte(`{}`), fetchSubj: fetch} {
		_, err := mal.Request(subj, body, refusedWait)
		require.Error(t, err, "no reply to a refused request")
		violation(t, malErrs, subj)
	}
	mjs, err := jetstream.New(mal)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), refusedWait)
	defer cancel()
	_, err = mjs.KeyValue(ctx, "kvactors_owners")
	require.Error(t, err, "the bucket cannot be bound")
	violation(t, malErrs, "$JS.API.STREAM.INFO.KV_kvactors_owners")
	// Reading a record directly, and forging one (a claim of ea for mal).
	direct := "$JS.API.DIRECT.GET.KV_kvactors_owners.$KV.kvactors_owners.ea"
	_, err = mal.Request(direct, nil, refusedWait)
	require.Error(t, err)
	violation(t, malErrs, direct)
	require.NoError(t, mal.Publish("$KV.kvactors_owners.ea", []byte(`{"node":"mal","boot":"b","lease_ms":2000}`)))
	require.NoError(t, mal.Flush())
	violation(t, malErrs, "$KV.kvactors_owners.ea")
	require.NoError(t, mal.Publish("$JS.API.STREAM.PURGE.KV_kvactors_owners", nil))
	require.NoError(t, mal.Flush())
	violation(t, malErrs, "$JS.API.STREAM.PURGE.KV_kvactors_owners")
	after, err := bucket.Get(context.Background(), "ea")
	require.NoError(t, err)
	require.Contains(t, string(after.Value()), `"node":"n0"`, "the ownership record is n0's")
	require.GreaterOrEqual(t, after.Revision(), before.Revision(), "only n0's keep-alives rewrote it")

	touch()

	// The nodes still serve well-behaved engines: n0 stores a second
	// prefix, n1 loads it remotely, ef is answered by its owner; no node or
	// well-behaved engine ever hit a permission error.
	hs2 := []string{hash("q", 0), hash("q", 1)}
	a.storePrefix("r2", hs2, 30, 31, 8, "second prefix stored through n0")
	awaitLookup(t, b, hs2, 8, "n1 of the second prefix")
	r = b.loadInto("rb2", hs2, 8, []int{4, 5})
	require.True(t, r.OK, r.Error)
	require.Equal(t, 2, r.RemoteChunks)
	require.True(t, bytes.Equal(a.block(0, 30), b.block(0, 4)))
	require.True(t, bytes.Equal(a.block(0, 31), b.block(0, 5)))
	msg, err = testkit.EngineRequest(f.e.nc, "ef", "kvactors.ef.lookup", []byte(`{"hashes":[]}`), 5*time.Second)
	require.NoError(t, err)
	var lr messages.LookupReply
	require.NoError(t, json.Unmarshal(msg.Data, &lr))
	require.Empty(t, lr.Error)
	require.Equal(t, rr.Node, lr.Node, "ef's lookup answered by its owner")
	for _, e := range sc.nodes {
		require.Zero(t, e.counter("kvactors_nats_events_total", "error"), "node %s had a NATS error", e.node.NodeID())
		require.Zero(t, e.counter("kvactors_cluster_fetch_failures_total", ""), "node %s failed a fetch", e.node.NodeID())
		// Each node caught up the key sets of the two others (P._node.<node>.keys).
		require.GreaterOrEqual(t, e.counter("kvactors_cluster_holders_catchups_total", "ok"), 2.0, "node %s", e.node.NodeID())
		require.Zero(t, e.counter("kvactors_cluster_holders_catchups_total", "error"), "node %s", e.node.NodeID())
	}
	select {
	case err := <-noErrs:
		t.Fatalf("a well-behaved engine hit an error: %v", err)
	default:
	}
}
