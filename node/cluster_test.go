package node_test

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// clusterLease is the lease of the cluster tests: the ownership bucket
// needs at least 1 s, and the scripted engines stay silent between steps.
const clusterLease = 2 * time.Second

// kvCluster is n nodes on a NATS cluster, n<i> given server i%3 first (its
// client may pick another) and its test connection on that server, sharing
// one shm directory (so any node can serve any engine unless its spec names
// one).
type kvCluster struct {
	t     *testing.T
	nats  *testkit.Cluster
	dir   string
	nodes []*env
}

func startCluster(t *testing.T, n int, mutate ...func(i int, c *node.Config)) *kvCluster {
	t.Helper()
	kc := &kvCluster{t: t, nats: testkit.NATSCluster(t, 3), dir: t.TempDir()}
	for i := range n {
		kc.nodes = append(kc.nodes, kc.startNode(i%3, fmt.Sprintf("n%d", i), mutate...))
	}
	kc.waitSeen()
	return kc
}

// storePrefix stores request req's two-chunk prefix hs (8 tokens) from
// blocks b0 and b1, filled with generation gen, and waits for its stored.
func (te *testEngine) storePrefix(req string, hs []string, b0, b1 messages.BlockID, gen byte, what string) {
	te.e.t.Helper()
	te.fill(0, b0, gen)
	te.fill(0, b1, gen)
	te.send(added(req, 8), hashesEv(req, 0, hs...), blocksEv(req, 0, 0, int(b0), int(b1)), tokensEv(req, 8, 8))
	recv(te.e.t, te.stored, what)
}

// engineOn is an engine (not yet registered) of node i ("n<i>"), in
// namespace ns.
func (kc *kvCluster) engineOn(i int, id, ns string) *testEngine {
	te := kc.nodes[i].newEngine(id, defaultOpts())
	te.spec.Node, te.spec.Namespace = fmt.Sprintf("n%d", i), ns
	return te
}

// startNode starts node id given server s first (the node may connect to
// another: its client randomizes the servers) and returns it with a client
// connection on server s.
func (kc *kvCluster) startNode(s int, id string, mutate ...func(i int, c *node.Config)) *env {
	t := kc.t
	t.Helper()
	reg := prometheus.NewRegistry()
	// A fetch from a node just gone may wait out its piece timeout (the
	// servers still route to its subscription): 1 s, under the tests' 5 s.
	cfg := node.Config{NATSURL: kc.nats.URLs(s), NodeID: id, Cluster: true, ClusterReplicas: 3, Lease: clusterLease,
		FetchTimeout: time.Second,
		ShmDir:       kc.dir, PoolBytes: 1 << 20, HTTPAddr: "127.0.0.1:0", Registry: reg,
		Log:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		FailStop: func(reason string) { t.Errorf("node %s fail-stopped: %s", id, reason) }} // not the binary's exit
	for _, m := range mutate {
		m(s, &cfg)
	}
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err, "start node %s", id)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	// Start subscribed and flushed on its server (any of the cluster's:
	// the client randomizes them); the others learn of it a little later.
	// An engine's first message sent through one of them meanwhile would
	// reach only the nodes already there.
	kc.nats.WaitRoutedTo(n.NATSServerID(), cmp.Or(cfg.Prefix, node.DefaultConfig().Prefix)+".anyengine.register")
	return &env{t: t, node: n, nc: kc.nats.Connect(s), reg: reg, dir: kc.dir}
}

// waitSeen waits until every node's feed has heard every other node.
func (kc *kvCluster) waitSeen() {
	testkit.Eventually(kc.t, 10*time.Second, 20*time.Millisecond, func() error {
		for _, e := range kc.nodes {
			if got := len(e.node.ClusterNodes()); got < len(kc.nodes)-1 {
				return fmt.Errorf("node %s sees %d other nodes", e.node.NodeID(), got)
			}
		}
		return nil
	})
}

func decisions(e *env, action string) float64 {
	return e.counter("kvactors_cluster_ownership_decisions_total", action)
}

// counter sums a counter of the node's registry: the series with a label
// of value label, or every series when label is "".
func (e *env) counter(name, label string) float64 {
	mfs, err := e.reg.Gather()
	require.NoError(e.t, err)
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := label == ""
			for _, l := range m.GetLabel() {
				match = match || l.GetValue() == label
			}
			if match {
				v += m.GetCounter().GetValue()
			}
		}
	}
	return v
}

// collect publishes one request and returns the channel of every reply.
func collect(t *testing.T, nc *nats.Conn, subject string, body any) <-chan *nats.Msg {
	t.Helper()
	data, err := json.Marshal(body)
	require.NoError(t, err)
	inbox := testkit.EngineInbox(strings.Split(subject, ".")[1]) // the engine's own (PROTOCOL.md replies)
	ch := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe(inbox, ch)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.PublishRequest(subject, inbox, data))
	return ch
}

// Concurrent registers of one engine reach all three nodes at once (one
// publish, three subscribers on three servers): exactly one node answers
// and serves it, the two others stay silent and count the message; then
// every other message of the engine is answered by that node only.
func TestClusterConcurrentRegistersEndWithOneOwner(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	for round := range 4 {
		id := fmt.Sprintf("e%d", round)
		te := kc.nodes[0].newEngine(id, defaultOpts())
		before := make([]float64, 3)
		for i, e := range kc.nodes {
			before[i] = decisions(e, "ignore")
		}
		replies := collect(t, kc.nodes[round%3].nc, "kvactors."+id+".register", te.spec)
		first := testkit.Recv(t, replies, 10*time.Second, "the register reply")
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(first.Data, &r))
		require.True(t, r.OK, r.Error)
		// The two losers decide (ignore) within the claim's round trips.
		testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
			ignored := 0
			for i, e := range kc.nodes {
				if decisions(e, "ignore") > before[i] {
					ignored++
				}
			}
			if ignored < 2 {
				return fmt.Errorf("%d nodes decided to ignore", ignored)
			}
			return nil
		})
		owners := 0
		for _, e := range kc.nodes {
			for _, eng := range e.node.Engines() {
				if eng == id {
					owners++
					require.Equal(t, r.Node, e.node.NodeID(), "the node that answered serves the engine")
				}
			}
		}
		require.Equal(t, 1, owners, "engine %s registered on exactly one node", id)
		testkit.NoRecv(t, replies, 200*time.Millisecond, "a second register reply")

		// A lookup is answered by the owner alone; the others count it.
		for i, e := range kc.nodes {
			before[i] = decisions(e, "ignore")
		}
		lookups := collect(t, kc.nodes[(round+1)%3].nc, "kvactors."+id+".lookup", map[string]any{"hashes": []string{hash("x", 0)}})
		var lr messages.LookupReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, lookups, 5*time.Second, "lookup reply").Data, &lr))
		require.Empty(t, lr.Error)
		require.Equal(t, r.Node, lr.Node)
		testkit.NoRecv(t, lookups, 200*time.Millisecond, "a second lookup reply")
		for i, e := range kc.nodes {
			if e.node.NodeID() != r.Node {
				require.Equal(t, before[i]+1, decisions(e, "ignore"), "node %s counted the lookup it ignored", e.node.NodeID())
			}
		}
	}
}

// A register naming another node than the live owner is refused by the
// owner, naming itself; no other node answers, and the engine is not reset.
func TestClusterRegisterNamingAnotherNodeIsRefusedByTheOwner(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	te := kc.nodes[1].newEngine("e1", defaultOpts())
	te.spec.Node = "n1"
	te.register()
	other := te.spec
	other.Node = "n2"
	replies := collect(t, kc.nodes[0].nc, "kvactors.e1.register", other)
	var r messages.RegisterReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "refusal").Data, &r))
	require.False(t, r.OK)
	require.Equal(t, "n1", r.Node)
	require.Contains(t, r.Error, "owned by node n1")
	testkit.NoRecv(t, replies, 300*time.Millisecond, "a second answer")
	require.Equal(t, []string{"e1"}, kc.nodes[1].node.Engines())
	require.Empty(t, kc.nodes[2].node.Engines())
}

// A register naming another engine's segment is refused bad_spec by every
// node alike, before any node looks the name up on its host: which nodes
// answer says nothing of where (or whether) that name exists. Each node
// here is a host of its own (its own shm dir); vic-kv exists on n0's only,
// vic-none nowhere, and vic-link on n2's is a link to n0's file.
func TestClusterRegisterNamingAnotherEnginesSegmentIsRefusedAlikeEverywhere(t *testing.T) {
	t.Parallel()
	dirs := []string{t.TempDir(), t.TempDir(), t.TempDir()}
	kc := startCluster(t, 3, func(i int, c *node.Config) { c.ShmDir = dirs[i] })
	seg, err := shm.Create(dirs[0], "vic-kv", 64*256)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	require.NoError(t, os.Symlink(filepath.Join(dirs[0], "vic-kv"), filepath.Join(dirs[2], "vic-link")))
	mal := kc.nodes[1].newEngine("mal", defaultOpts())
	var answers []string
	for _, name := range []string{"vic-kv", "vic-none", "vic-link"} {
		before := make([]float64, 3)
		for i, e := range kc.nodes {
			before[i] = rejected(t, e, "bad_spec")
		}
		spec := mal.spec
		spec.Segments = []messages.Segment{{Shm: name}}
		replies := collect(t, kc.nodes[1].nc, "kvactors.mal.register", spec)
		from := map[string]string{}
		for range kc.nodes {
			var r messages.RegisterReply
			require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "a refusal of "+name).Data, &r))
			require.False(t, r.OK, name)
			require.Contains(t, r.Error, `is not engine "mal"'s`, name)
			from[r.Node] = r.Error
		}
		require.Len(t, from, 3, "%s: refused by every node", name)
		testkit.NoRecv(t, replies, 200*time.Millisecond, "a fourth answer")
		for i, e := range kc.nodes {
			require.Equal(t, before[i]+1, rejected(t, e, "bad_spec"), "%s: counted bad_spec on %s", name, e.node.NodeID())
			require.Empty(t, e.node.Engines())
		}
		for _, msg := range from {
			answers = append(answers, strings.ReplaceAll(msg, name, "NAME"))
		}
	}
	for _, a := range answers {
		require.Equal(t, answers[0], a, "the same answer from every node, whether or not the name exists there")
	}
}

// A prefix stored through node A is counted by lookup on node C and loads
// byte-identically through C: fetched over P._node.n0.fetch (remote_chunks),
// verified, stored in C's pool and copied to C's engine.
func TestClusterPrefixStoredOnALoadsByteIdenticallyOnC(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(2, "ec", "m")
	other := kc.engineOn(2, "eo", "other")
	a.register()
	c.register()
	c.keepAlive(clusterLease / 8) // heard while it waits on A's store and other's lookup
	other.register()

	hs := []string{hash("x", 0), hash("x", 1), hash("x", 2), hash("x", 3)}
	for i := range 4 {
		a.fill(0, messages.BlockID(40+i), 77)
	}
	a.send(added("r", 16), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 40, 41, 42, 43), tokensEv("r", 16, 16))
	recv(t, a.stored, "stored by A")
	awaitLookup(t, c, hs, 16, "C")
	require.Equal(t, 0, other.lookup(hs), "another namespace does not see the prefix")
	r := c.loadInto("rc", hs, 16, []int{2, 3, 4, 5})
	require.True(t, r.OK, r.Error)
	require.Equal(t, "n2", r.Node)
	require.Equal(t, 4, r.RemoteChunks)
	for i := range 4 {
		require.True(t, bytes.Equal(a.block(0, messages.BlockID(40+i)), c.block(0, messages.BlockID(2+i))),
			"block %d loaded on C equals the one stored on A", i)
	}
	// Now in C's pool: a second load is local.
	r = c.loadInto("rc2", hs, 16, []int{6, 7, 8, 9})
	require.True(t, r.OK, r.Error)
	require.Zero(t, r.RemoteChunks)
	require.Positive(t, kc.nodes[2].counter("kvactors_cluster_fetch_bytes_total", ""))

	// A second engine registers on A: its AllBlocksCleared (the contract's,
	// naming no namespace) leaves A's pool, and what the other nodes know
	// of it, as they were: B counts the prefix held only by A
	// (TestClusterAnEnginesFirstRegisterDropsNoOtherTenantsHolders).
	b := kc.engineOn(1, "eb", "m")
	b.register()
	a2 := kc.engineOn(0, "ea2", "m")
	a2.register()
	awaitLookup(t, b, hs, 16, "B of A's prefix")
}

// The holder goes away between lookup and load (its fetch server is gone
// before the lease drops it from the index): the load fails with an error
// naming the key, nothing is copied into the engine's blocks, and the slots
// reserved for the fetch are freed (a later store of the prefix works).
func TestClusterLoadFailsCleanlyWhenTheHolderIsGone(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(2, "ec", "m")
	a.register()
	c.register()
	c.keepAlive(clusterLease / 8) // heard while A closes
	hs := []string{hash("g", 0), hash("g", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A")
	awaitLookup(t, c, hs, 8, "C")
	require.NoError(t, kc.nodes[0].node.Close(context.Background()))
	before := append([]byte(nil), c.block(0, 2)...)
	r := c.loadInto("rc", hs, 8, []int{2, 3})
	require.False(t, r.OK)
	// The first chunk that failed is named (either: they are fetched at once).
	require.Regexp(t, regexp.QuoteMeta("fetch key "+node.ClusterNamespace("ec", "m", &c.spec)+"/")+
		"("+hs[0]+"|"+hs[1]+")", r.Error)
	require.Contains(t, r.Error, "from node n0")
	require.Equal(t, before, c.block(0, 2), "no byte reached the engine's block")
	require.Positive(t, kc.nodes[2].counter("kvactors_cluster_fetch_failures_total", ""))
	// The reserved slots were freed: C stores the prefix itself.
	c.storePrefix("own", hs, 10, 11, 3, "stored by C after the failed fetch")
}

// The fetch server serves a key only in the namespace it was announced in:
// the same key asked for in another namespace is refused, so a node never
// hands one tenant's chunk to a fetch naming another.
func TestClusterFetchServesOnlyTheAnnouncedNamespace(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	a := kc.engineOn(0, "ea", "m")
	a.register()
	a.fill(0, 7, 4)
	a.send(added("r", 4), hashesEv("r", 0, hash("f", 0)), blocksEv("r", 0, 0, 7), tokensEv("r", 4, 4))
	recv(t, a.stored, "stored by A")
	f, err := cluster.NewFetcher(kc.nodes[1].nc, cluster.Config{Lease: clusterLease, FetchTimeout: time.Second}, nil)
	require.NoError(t, err)
	key := messages.Key(append(mustHex(hash("f", 0)), 0, 0, 0, 0)) // group 0
	// A chunk is served once the journal has announced it (kv_events, up to
	// --kv-events-linger after its stored message).
	var got []byte
	m := node.ClusterNamespace("ea", "m", &a.spec)
	require.Eventually(t, func() bool {
		got, err = f.Fetch(context.Background(), "n0", m, key)
		return err == nil
	}, 10*time.Second, 5*time.Millisecond, "fetch of the stored chunk")
	require.Equal(t, a.block(0, 7), got, "the chunk as stored (one 256-byte block per slot)")
	_, err = f.Fetch(context.Background(), "n0", node.ClusterNamespace("ea", "other", &a.spec), key)
	require.ErrorIs(t, err, cluster.ErrRefused)
	_, err = f.Fetch(context.Background(), "n0", node.ClusterNamespace("ea", "ea", &a.spec), key)
	require.ErrorIs(t, err, cluster.ErrRefused, "not even the engine id's default namespace")
	_, err = f.Fetch(context.Background(), "n0", node.ClusterNamespace("m", "m", &a.spec), key)
	require.ErrorIs(t, err, cluster.ErrRefused, "nor the own namespace of an engine named m")
	_, err = f.Fetch(context.Background(), "n0", messages.NamespaceKey("ea", "m"), key)
	require.ErrorIs(t, err, cluster.ErrRefused, "nor the namespace without its geometry (a node of an older version)")
	other := a.spec
	other.BlocksPerChunk = 2
	other.Groups = slices.Clone(other.Groups)
	other.Groups[0].Regions = []messages.Region{{Segment: 0, BlockStride: 128, BlockBytes: 128}}
	_, err = f.Fetch(context.Background(), "n0", node.ClusterNamespace("ea", "m", &other), key)
	require.ErrorIs(t, err, cluster.ErrRefused, "nor the namespace under another geometry")
}

// A namespace's geometry is fixed per node (its first engine in the boot),
// so two nodes may hold one namespace under two geometries (a rolling change
// of KV dtype or block size that keeps the name). A's chunks (one 256-byte
// block each) are the same size as a chunk of C's engine (two 128-byte
// blocks), and C's chunk-0 key is A's chunk-1 key: C must not count A's
// chunks, and its load must not write A's bytes into its blocks. B, of A's
// geometry, still counts and loads them byte-identically.
func TestClusterGeometryIsPartOfTheNamespaceAcrossNodes(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	a := kc.engineOn(0, "ea", "m")
	a.register()
	hs := []string{hash("geo", 0), hash("geo", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A")

	b := kc.engineOn(1, "eb", "m") // A's geometry, another node: the control
	b.register()
	awaitLookup(t, b, hs, 8, "B (A's geometry)")
	r := b.loadInto("rb", hs, 8, []int{5, 6})
	require.True(t, r.OK, "B's load: %s", r.Error)
	require.Equal(t, 2, r.RemoteChunks)
	require.Equal(t, a.block(0, 40), b.block(0, 5), "B's block 5 is A's chunk 0")
	require.Equal(t, a.block(0, 41), b.block(0, 6), "B's block 6 is A's chunk 1")

	o := defaultOpts()
	o.bpc, o.blockBytes = 2, 128
	c := kc.nodes[2].newEngine("ec", o)
	c.spec.Node, c.spec.Namespace = "n2", "m"
	c.register() // n2 has never seen m: it takes C's geometry
	// C's node knows A's chunks (and B's fetched copies) before C asks.
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		for _, ni := range kc.nodes[2].node.ClusterNodes() {
			if ni.Node == "n0" && ni.Keys >= 2 && ni.Live {
				return nil
			}
		}
		return fmt.Errorf("n2 does not know n0's keys yet: %+v", kc.nodes[2].node.ClusterNodes())
	})
	require.Zero(t, c.lookup(hs), "C counts no chunk stored under another geometry")
	c.fill(0, 2, 77)
	c.fill(0, 3, 78)
	before2, before3 := bytes.Clone(c.block(0, 2)), bytes.Clone(c.block(0, 3))
	r = c.loadInto("rc", hs, 8, []int{2, 3})
	require.False(t, r.OK, "C's load of a prefix held only under another geometry")
	require.Zero(t, r.RemoteChunks)
	require.Equal(t, before2, c.block(0, 2), "C's block 2 untouched")
	require.Equal(t, before3, c.block(0, 3), "C's block 3 untouched")
	require.Zero(t, kc.nodes[2].counter("kvactors_cluster_fetch_bytes_total", ""), "nothing fetched for C")
}

// Two engines of one namespace on C load the same remote prefix at once:
// one load fetches each chunk, the other waits for it instead of failing
// as a miss; both get A's bytes, and each chunk crossed the wire once.
func TestClusterConcurrentLoadsOfOneRemotePrefixBothSucceed(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	a := kc.engineOn(0, "ea", "m")
	a.register()
	var cs []*testEngine
	for _, id := range []string{"c1", "c2"} {
		c := kc.engineOn(1, id, "m")
		c.register()
		cs = append(cs, c)
	}
	hs := []string{hash("w", 0), hash("w", 1), hash("w", 2), hash("w", 3)}
	for i := range 4 {
		a.fill(0, messages.BlockID(20+i), 6)
	}
	a.send(added("r", 16), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 20, 21, 22, 23), tokensEv("r", 16, 16))
	recv(t, a.stored, "stored by A")
	awaitLookup(t, cs[0], hs, 16, "n1")
	replies := make(chan messages.LoadReply, 2)
	for i, c := range cs {
		body, err := json.Marshal(map[string]any{"request": "l", "hashes": hs, "num_tokens": 16,
			"blocks": [][]int{{2 + i*10, 3 + i*10, 4 + i*10, 5 + i*10}}})
		require.NoError(t, err)
		go func() {
			var r messages.LoadReply
			m, err := testkit.EngineRequest(c.e.nc, c.id, "kvactors."+c.id+".load", body, 5*time.Second)
			if err != nil {
				r.Error = err.Error()
			} else if err := json.Unmarshal(m.Data, &r); err != nil {
				r.Error = err.Error()
			}
			replies <- r
		}()
	}
	remote := 0
	for range 2 {
		r := testkit.Recv(t, replies, 10*time.Second, "load reply")
		require.True(t, r.OK, r.Error)
		remote += r.RemoteChunks
	}
	require.Equal(t, 4, remote, "each chunk fetched once")
	for i, c := range cs {
		for j := range 4 {
			require.Equal(t, a.block(0, messages.BlockID(20+j)), c.block(0, messages.BlockID(2+i*10+j)))
		}
	}
}

// A chunk corrupted in the holder's host memory is never fetched: the
// holder checks it against the checksum its store took at the copy from
// the device, drops it and refuses; the load through C fails naming the key
// and no byte reaches C's engine, and C's pool does not keep it.
func TestClusterCorruptChunkOnTheHolderIsNeverLoadedElsewhere(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(1, "ec", "m")
	a.register()
	c.register()
	hs := []string{hash("z", 0), hash("z", 1)}
	a.storePrefix("r", hs, 1, 2, 3, "stored by A")
	awaitLookup(t, c, hs, 8, "C")
	arena := kc.nodes[0].node.Arena().Bytes()
	at := bytes.Index(arena, a.block(0, 2))
	require.GreaterOrEqual(t, at, 0, "chunk 1's bytes are in A's pool")
	arena[at+5] ^= 0x10

	c.fill(0, 30, 8)
	c.fill(0, 31, 8)
	dst := bytes.Clone(c.block(0, 31))
	r := c.loadInto("rc", hs, 8, []int{30, 31})
	require.False(t, r.OK)
	require.Contains(t, r.Error, "fetch key "+node.ClusterNamespace("ec", "m", &c.spec)+"/"+hs[1])
	require.Contains(t, r.Error, "checksum mismatch")
	require.Equal(t, dst, c.block(0, 31), "no byte of the corrupt chunk reached C's engine")
	require.Equal(t, 1.0, kc.nodes[0].counter("kvactors_pool_corrupt_chunks_total", ""), "A dropped it")
	require.Positive(t, kc.nodes[1].counter("kvactors_cluster_fetch_failures_total", ""))
	// The corrupt chunk is counted nowhere once A's BlockRemoved is seen.
	awaitLookup(t, c, hs, 4, "C (A's removal seen)")
}

// A chunk fetched into C's pool is announced by C (BlockStored on the
// loading engine's kv_events), so it is held twice: once A is gone, B still
// loads the prefix, from C.
func TestClusterFetchedChunksAreServedOnward(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	var es []*testEngine
	for i, id := range []string{"ea", "eb", "ec"} {
		te := kc.engineOn(i, id, "m")
		te.register()
		es = append(es, te)
	}
	a, b, c := es[0], es[1], es[2]
	hs := []string{hash("o", 0), hash("o", 1)}
	a.fill(0, 5, 2)
	a.fill(0, 6, 2)
	want := append(bytes.Clone(a.block(0, 5)), a.block(0, 6)...)
	a.send(added("r", 8), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 5, 6), tokensEv("r", 8, 8))
	recv(t, a.stored, "stored by A")
	awaitLookup(t, c, hs, 8, "C")
	r := c.loadInto("rc", hs, 8, []int{1, 2})
	require.True(t, r.OK, r.Error)
	require.Equal(t, 2, r.RemoteChunks)
	fetched := recvKVHashes(t, c, messages.KVBlockStored, messages.MediumCPU, "m", len(hs)) // each fetch on its own
	require.ElementsMatch(t, hs, fetched, "C's BlockStored for the fetched chunks")

	require.NoError(t, kc.nodes[0].node.Close(context.Background()))
	testkit.Eventually(t, 3*clusterLease, 20*time.Millisecond, func() error {
		// B's engine speaks meanwhile, as a live engine does every lease/4
		// (silent for lease/2, its next load would be refused until it
		// resyncs: PROTOCOL.md "Engine silence").
		b.heartbeat(b.epoch, b.seq)
		for _, ni := range kc.nodes[1].node.ClusterNodes() {
			if ni.Node == "n0" && ni.Live {
				return fmt.Errorf("B still counts A")
			}
		}
		return nil
	})
	require.Equal(t, 8, b.lookup(hs), "held by C")
	r = b.loadInto("rb", hs, 8, []int{3, 4})
	require.True(t, r.OK, r.Error)
	require.Equal(t, 2, r.RemoteChunks)
	require.Equal(t, want, append(bytes.Clone(b.block(0, 3)), b.block(0, 4)...))
}

// Isolation across a refused re-register: an engine that re-registers
// naming another tenant's namespace with a spec the node refuses (its
// geometry differs from that namespace's) keeps its own namespace. Its
// lookups never count, and its loads never fetch, the other namespace's
// chunks held on another node.
func TestClusterRefusedReregisterKeepsTheEnginesNamespace(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 3)
	a := kc.engineOn(0, "ea", "m")
	c := kc.engineOn(2, "ec", "own")
	a.register()
	c.register()
	hs := []string{hash("iso", 0), hash("iso", 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A in namespace m")
	// A third engine of namespace m on C's node sees the prefix: the holders
	// index has it, so the check below is not vacuous.
	probe := kc.engineOn(2, "ep", "m")
	probe.register()
	awaitLookup(t, probe, hs, 8, "a namespace-m engine on n2")

	bad := c.spec
	bad.Namespace = "m"
	bad.Groups = append([]messages.GroupSpec(nil), c.spec.Groups...)
	bad.Groups[0].Regions = []messages.Region{{BlockStride: 128, BlockBytes: 128}} // m's blocks are 256 bytes
	reply := c.request("register", bad)
	require.Contains(t, string(reply), `"error"`, "a spec whose geometry differs from namespace m's is refused")
	require.NotContains(t, string(reply), `"ok":true`)
	t.Logf("refused: %s", reply)
	require.Zero(t, c.lookup(hs), "ec still counts in its own namespace only")
	before := append([]byte(nil), c.block(0, 2)...)
	r := c.loadInto("rc", hs, 8, []int{2, 3})
	require.False(t, r.OK, "ec cannot load namespace m's chunks")
	require.Zero(t, r.RemoteChunks)
	require.Equal(t, before, c.block(0, 2), "no byte of m's chunks reached ec's blocks")
}

// prefixSeenAcross registers ea on node 0 and eb on node 1, both in
// namespace m, has ea store a two-hash prefix (seed names its hashes) and
// waits until eb counts it: a chunk of one node that another node's holder
// index counts.
func prefixSeenAcross(t *testing.T, kc *kvCluster, seed string) (a, b *testEngine, hs []string) {
	t.Helper()
	a, b = kc.engineOn(0, "ea", "m"), kc.engineOn(1, "eb", "m")
	a.register()
	b.register()
	hs = []string{hash(seed, 0), hash(seed, 1)}
	a.storePrefix("r", hs, 40, 41, 9, "stored by A in namespace m")
	awaitLookup(t, b, hs, 8, "B of A's prefix")
	return a, b, hs
}
