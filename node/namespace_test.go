package node_test

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// An engine that names another engine's id as its namespace does not join
// that engine's own namespace (PROTOCOL.md: an engine that names none
// "shares with nobody unless it says so"): whether the victim registered
// first or last, the squatter's lookup of the victim's prefix is a miss, its
// load copies none of the victim's bytes, and the victim is untouched. Two
// engines that both name the id share a namespace of that name, as any
// shared name.
func TestAnEngineNamingAnotherEnginesIDDoesNotJoinItsNamespace(t *testing.T) {
	t.Parallel()
	t.Run("victim first", func(t *testing.T) {
		e := startNode(t)
		vic, hs, want := victim(t, e) // engine "vic", no namespace
		mal := e.newEngine("mal", defaultOpts())
		mal.spec.Namespace = "vic"
		mal.register()
		requireNothingOf(t, mal, hs, want)
		intact(t, vic, hs, want)
	})
	t.Run("squatter first", func(t *testing.T) {
		e := startNode(t)
		mal := e.newEngine("mal", defaultOpts())
		mal.spec.Namespace = "vic"
		mal.register()
		vic, hs, want := victim(t, e) // registers after: its own namespace all the same
		requireNothingOf(t, mal, hs, want)
		intact(t, vic, hs, want)

		// A second engine naming "vic" shares the squatter's namespace.
		other := e.newEngine("other", defaultOpts())
		other.spec.Namespace = "vic"
		other.register()
		shared := []string{hash("s", 0)}
		mal.fill(0, 7, 9)
		mal.send(added("s", 4), hashesEv("s", 0, shared...), blocksEv("s", 0, 0, 7), tokensEv("s", 4, 4))
		recv(t, mal.stored, "the squatter's store")
		require.Equal(t, 4, other.lookup(shared), "engines naming the same namespace share it")
		require.Equal(t, 0, vic.lookup(shared), "the engine whose id it is does not")
	})
}

// requireNothingOf checks that mal sees none of the victim's chunks: no
// lookup hit, and a load into its own blocks copies none of the victim's
// bytes there.
func requireNothingOf(t *testing.T, mal *testEngine, hs []string, want [][]byte) {
	t.Helper()
	require.Equal(t, 0, mal.lookup(hs), "another engine's prefix is a miss")
	for i := range 4 {
		mal.fill(0, messages.BlockID(10+i), 1)
	}
	r := mal.loadInto("steal", hs, 16, []int{10, 11, 12, 13})
	require.False(t, r.OK, "a load of another engine's chunks fails")
	for i := range 4 {
		require.False(t, bytes.Equal(want[i], mal.block(0, messages.BlockID(10+i))), "the victim's bytes copied")
	}
}

// One engine cannot use up the namespaces of the node's boot (16 ×
// --max-engines, never given back) for every other engine: an engine id
// opens at most 16, and another engine still registers.
func TestOneEngineCannotUseUpTheNodesNamespaces(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.MaxEngines = 2 }) // 32 in all
	mal := e.newEngine("mal", defaultOpts())
	for i := range 16 {
		mal.spec.Namespace = fmt.Sprintf("burn-%d", i)
		mal.register()
	}
	mal.spec.Namespace = "burn-16"
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(mal.request("register", mal.spec), &reply))
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, `engine "mal" opened 16 namespaces since the node last forgot its id`)
	vic := e.newEngine("vic", defaultOpts())
	vic.register()
}

// Across a cluster too, an engine naming another engine's id as its
// namespace reads nothing of that engine's own: mal on n1 names "vic"; vic
// (its own namespace) on n0 stores a prefix. Every engine registers first
// (a first register clears what other nodes believe this node holds), then
// vic stores, then a shared namespace's chunk is stored on n0: once n1
// counts that one, vic's earlier announcement has reached n1 too. mal's
// lookup of vic's prefix is still a miss, and its load fetches and copies
// none of vic's bytes.
func TestAClusterServesNoEngineItsNamesakesNamespace(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	mal, vic := kc.engineOn(1, "mal", "vic"), kc.engineOn(0, "vic", "")
	sa, sb := kc.engineOn(0, "sa", "m"), kc.engineOn(1, "sb", "m")
	for _, te := range []*testEngine{mal, vic, sa, sb} {
		te.register()
	}
	hs := []string{hash("v", 0), hash("v", 1)}
	vic.fill(0, 5, 77)
	vic.fill(0, 6, 77)
	want := [][]byte{bytes.Clone(vic.block(0, 5)), bytes.Clone(vic.block(0, 6))}
	vic.send(added("r", 8), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 5, 6), tokensEv("r", 8, 8))
	recv(t, vic.stored, "vic's store")
	shared := []string{hash("s", 0)}
	sa.send(added("s", 4), hashesEv("s", 0, shared...), blocksEv("s", 0, 0, 7), tokensEv("s", 4, 4))
	recv(t, sa.stored, "the shared namespace's store")
	awaitLookup(t, sb, shared, 4, "n1 for the shared namespace")

	require.Equal(t, 0, mal.lookup(hs), "vic's prefix counted for its namesake on another node")
	mal.fill(0, 10, 1)
	mal.fill(0, 11, 1)
	r := mal.loadInto("steal", hs, 8, []int{10, 11})
	require.False(t, r.OK, "a load of vic's chunks from another node")
	require.Zero(t, r.RemoteChunks)
	require.NotEqual(t, want[0], mal.block(0, 10))
	require.NotEqual(t, want[1], mal.block(0, 11))
}

// kvSeen is one kv_events message as a router on P.*.kv_events takes it:
// the engine of its subject and its events.
type kvSeen struct {
	engine string
	events []messages.KVEvent
}

// kvTap subscribes once to every engine's kv_events: one subscription keeps
// the node's publish order across engines.
func kvTap(t *testing.T, e *env) <-chan kvSeen {
	t.Helper()
	ch := make(chan kvSeen, 1024)
	sub, err := e.nc.Subscribe("kvactors.*.kv_events", func(m *nats.Msg) {
		var b messages.KVEventBatch
		if err := jsonUnmarshal(m.Data, &b); err != nil {
			t.Errorf("kv_events %q: %v", m.Data, err)
			return
		}
		ch <- kvSeen{engine: strings.Split(m.Subject, ".")[1], events: b.Events}
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, e.nc.Flush())
	return ch
}

// kvUntil reads tap until an event of typ naming h; it returns the engine
// it came on and fails if any message before it, or it, went to an engine
// in skip.
func kvUntil(t *testing.T, tap <-chan kvSeen, typ, h string, skip ...string) string {
	t.Helper()
	for {
		m := recv(t, tap, typ+" "+h)
		require.NotContains(t, skip, m.engine, "kv_events on an engine that left the namespace: %+v", m.events)
		for _, ev := range m.events {
			if ev.Type == typ && slices.Contains(ev.BlockHashes, h) {
				return m.engine
			}
		}
	}
}

// An engine that leaves a shared namespace hears nothing more of it
// (PROTOCOL.md "Isolation": no engine learns another namespace's hashes).
// e2 then e1 register in "shared" (e1 announces the namespace's changes
// that no member made); e1 leaves, by unregistering or by registering in
// another namespace; e2 stores a chunk, and e3 (its own namespace, a pool
// of 2 slots) stores two and evicts it. The BlockRemoved goes on e2, the
// member left, never on e1. Once every member has left, an eviction of the
// namespace is announced to nobody until an engine joins it: then on that
// engine, which announces its changes from then on.
func TestAnEngineThatLeftANamespaceHearsNothingMoreOfIt(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"unregister", "register elsewhere"} {
		t.Run(how, func(t *testing.T) {
			e := startNode(t, withPoolSlots(2))
			e2, e1, e3 := e.newEngine("e2", defaultOpts()), e.newEngine("e1", defaultOpts()), e.newEngine("e3", defaultOpts())
			for _, te := range []*testEngine{e2, e1} {
				te.spec.Namespace = "shared"
				te.register()
			}
			e3.register()
			if how == "unregister" {
				var un messages.UnregisterReply
				require.NoError(t, jsonUnmarshal(e1.request("unregister", map[string]any{}), &un))
				require.True(t, un.OK, un.Error)
			} else {
				e1.spec.Namespace = "mine"
				e1.register()
			}
			tap := kvTap(t, e)
			e2.storeOne("s1", 1)
			e3.storeOne("x1", 1)
			e3.storeOne("x2", 2) // evicts s1's chunk, the least recently used
			require.Equal(t, "e2", kvUntil(t, tap, messages.KVBlockRemoved, hash("s1", 0), "e1"),
				"the eviction is announced on the member left")
			if how != "unregister" {
				return
			}
			// No member: e2 stores, leaves, and e3 evicts its chunk.
			e2.storeOne("s2", 2) // evicts x1
			// announced on e2 while it is a member (a change drained after
			// its maker left would go to the namespace's members: none)
			require.Equal(t, "e2", kvUntil(t, tap, messages.KVBlockStored, hash("s2", 0), "e1"))
			require.NoError(t, jsonUnmarshal(e2.request("unregister", map[string]any{}), &messages.UnregisterReply{}))
			e3.storeOne("x3", 3) // evicts x2
			e3.storeOne("x4", 4) // evicts s2's chunk: nobody to tell yet
			for {
				m := recv(t, tap, "x4's BlockStored")
				require.Equal(t, "e3", m.engine, "only e3 is told: %+v", m.events)
				if slices.ContainsFunc(m.events, func(ev messages.KVEvent) bool {
					return ev.Type == messages.KVBlockStored && slices.Contains(ev.BlockHashes, hash("x4", 0))
				}) {
					break
				}
			}
			// A new member is told of that eviction, and announces the
			// namespace's changes again.
			e4 := e.newEngine("e4", defaultOpts())
			e4.spec.Namespace = "shared"
			e4.register()
			require.Equal(t, "e4", kvUntil(t, tap, messages.KVBlockRemoved, hash("s2", 0), "e1", "e2"),
				"the eviction made while the namespace had no member")
			e3.storeOne("x5", 5) // evicts x3
			e4.storeOne("s3", 3) // evicts x4
			e3.storeOne("x6", 6) // evicts x5
			e3.storeOne("x7", 7) // evicts s3's chunk
			require.Equal(t, "e4", kvUntil(t, tap, messages.KVBlockRemoved, hash("s3", 0), "e1", "e2"))
		})
	}
}

// A --max-engines large enough to mean "no bound" still lets an engine
// register: the node's namespace bound (16 × --max-engines) saturates
// rather than wrapping negative and refusing every register.
func TestAHugeMaxEnginesStillLetsAnEngineRegister(t *testing.T) {
	t.Parallel()
	for _, most := range []int{math.MaxInt, math.MaxInt / 16, math.MaxInt/16 + 1} {
		e := startNode(t, func(c *node.Config) { c.MaxEngines = most })
		e.newEngine("e1", defaultOpts()).register()
	}
}
