package node_test

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// nsRouter is what a router on P.*.kv_events believes one node holds in
// host memory: per namespace name (PROTOCOL.md "Isolation": "namespace":N
// on P.E.kv_events is E's own when N is E, shared otherwise; these tests'
// names do not collide), the block hashes held. An AllBlocksCleared
// forgets its "namespace", else the engine's own.
type nsRouter map[string]map[string]bool

func (r nsRouter) apply(m kvSeen) {
	for _, ev := range m.events {
		ns := ev.Namespace
		if ns == "" {
			ns = m.engine
		}
		switch {
		case ev.Type == messages.KVAllBlocksCleared:
			delete(r, ns)
		case ev.Medium != messages.MediumCPU:
		case ev.Type == messages.KVBlockStored:
			if r[ns] == nil {
				r[ns] = map[string]bool{}
			}
			for _, h := range ev.BlockHashes {
				r[ns][h] = true
			}
		case ev.Type == messages.KVBlockRemoved:
			for _, h := range ev.BlockHashes {
				delete(r[ns], h)
			}
		}
	}
}

// until applies what tap brings until an event of typ naming h (h "":
// any) and returns the engine it came on.
func (r nsRouter) until(t *testing.T, tap <-chan kvSeen, typ, h string) string {
	t.Helper()
	for {
		m := recv(t, tap, typ+" "+h)
		r.apply(m)
		if slices.ContainsFunc(m.events, func(ev messages.KVEvent) bool {
			return ev.Type == typ && (h == "" || slices.Contains(ev.BlockHashes, h))
		}) {
			return m.engine
		}
	}
}

// believed is the hashes of hs the router believes held in namespace ns.
func (r nsRouter) believed(ns string, hs ...string) []string {
	return slices.DeleteFunc(slices.Clone(hs), func(h string) bool { return !r[ns][h] })
}

// held is the hashes of hs te's lookup finds (te's namespace).
func held(te *testEngine, hs ...string) []string {
	return slices.DeleteFunc(slices.Clone(hs), func(h string) bool { return te.lookup([]string{h}) == 0 })
}

// A namespace with no member still has its chunks evicted by other
// namespaces' engines. A router that follows the node's kv_events ends
// believing what the pool holds of it once an engine joins it again: the
// evictions made while it had none are published on that engine before
// anything else of the namespace (PROTOCOL.md "kv_events"). e2 stores two
// chunks of "shared" and unregisters; e3 (its own namespace; a pool of 2
// chunks) evicts both; e2 comes back, or a new engine e4 joins "shared",
// and stores one. Past the deferral bound the namespace is cleared instead
// (the router forgets more, never believes a chunk held that is gone).
func TestARouterFollowsANamespaceThatHadNoMember(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, joiner string
		bound        int
	}{
		{"its engine comes back", "e2", 0},
		{"another engine joins", "e4", 0},
		{"past the bound", "e2", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := []func(*node.Config){withPoolSlots(2)}
			if tc.bound > 0 {
				opts = append(opts, node.WithKVDeferBound(tc.bound))
			}
			e := startNode(t, opts...)
			tap := kvTap(t, e)
			r := nsRouter{}
			e2, e3 := e.newEngine("e2", defaultOpts()), e.newEngine("e3", defaultOpts())
			e2.spec.Namespace = "shared"
			e2.register()
			e3.register()
			e2.storeOne("s1", 1)
			e2.storeOne("s2", 2)
			r.until(t, tap, messages.KVBlockStored, hash("s2", 0))
			require.Equal(t, []string{hash("s1", 0), hash("s2", 0)}, r.believed("shared", hash("s1", 0), hash("s2", 0)))
			var un messages.UnregisterReply
			require.NoError(t, jsonUnmarshal(e2.request("unregister", map[string]any{}), &un))
			require.True(t, un.OK, un.Error)

			e3.storeOne("x1", 1) // evicts s1's chunk: "shared" has no member
			e3.storeOne("x2", 2) // evicts s2's
			r.until(t, tap, messages.KVBlockStored, hash("x2", 0))

			joiner := e2
			if tc.joiner != "e2" {
				joiner = e.newEngine(tc.joiner, defaultOpts())
				joiner.spec.Namespace = "shared"
			}
			joiner.register()
			joiner.epoch, joiner.seq = "ep2", 0 // a new session
			// at the join, before anything else of the namespace
			if tc.bound > 0 {
				require.Equal(t, tc.joiner, r.until(t, tap, messages.KVAllBlocksCleared, ""))
				require.NotContains(t, r, "shared", "the clear names the namespace")
			} else {
				require.Equal(t, tc.joiner, r.until(t, tap, messages.KVBlockRemoved, hash("s2", 0)))
			}
			joiner.storeOne("s3", 3) // evicts x1's chunk
			r.until(t, tap, messages.KVBlockStored, hash("s3", 0))

			shared := []string{hash("s1", 0), hash("s2", 0), hash("s3", 0)}
			own := []string{hash("x1", 0), hash("x2", 0)}
			require.Equal(t, held(joiner, shared...), r.believed("shared", shared...), "the router's view of shared")
			require.Equal(t, []string{hash("s3", 0)}, held(joiner, shared...))
			require.Equal(t, held(e3, own...), r.believed("e3", own...), "the router's view of e3's namespace")

			deferred := metricValue(t, e.reg, "kvactors_kv_events_deferred_total", nil)
			dropped := metricValue(t, e.reg, "kvactors_kv_events_deferred_dropped_total", nil)
			if tc.bound > 0 {
				require.Equal(t, []float64{2, 2}, []float64{deferred, dropped})
			} else {
				require.Equal(t, []float64{2, 0}, []float64{deferred, dropped})
			}
		})
	}
}
