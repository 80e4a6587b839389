package node_test

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/node"
)

// churn registers n fresh engine ids in turn (prefix-i), each storing a
// chunk in its own namespace and unregistering, and returns their engines.
// Each register must succeed.
func churn(t *testing.T, e *env, prefix string, n int) []*testEngine {
	t.Helper()
	var es []*testEngine
	for i := range n {
		te := e.newEngine(fmt.Sprintf("%s%d", prefix, i), defaultOpts())
		te.register()
		te.fill(0, 1, 1)
		te.storeOne(fmt.Sprintf("r%d", i), 1)
		te.unregister()
		es = append(es, te)
	}
	return es
}

// Engines under fresh ids (pod names) that come and go each open a
// namespace (their own, the default): the node's table of them forgets a
// namespace with the id that opened it, so it never fills for good (it
// refused every new id past 16 × --max-engines in a boot, until a restart:
// PROTOCOL.md "do not grow the node for its life"). An id forgotten that
// comes back gets a fresh namespace, which stores and loads its bytes.
func TestFreshIDsNeverFillTheNamespaceTable(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.MaxEngines = 1 }) // 16 namespaces at once
	es := churn(t, e, "pod", 40)
	t.Logf("namespaces held after 40 fresh ids: %d", e.node.NamespacesHeld())
	require.LessOrEqual(t, e.node.NamespacesHeld(), 16)

	back := es[0] // forgotten: its namespace with it
	back.register()
	back.epoch, back.seq = "ep2", 0 // a new session's epoch, as an SDK starts
	require.Equal(t, 0, back.lookup([]string{hash("r0", 0)}), "a forgotten namespace's chunk is unreachable")
	back.fill(0, 2, 9)
	want := bytes.Clone(back.block(0, 2))
	back.storeOne("again", 2)
	r := back.loadInto("load", []string{hash("again", 0)}, 4, []int{5})
	require.True(t, r.OK, r.Error)
	require.Equal(t, want, back.block(0, 5))
}

// A namespace with a registered member is never forgotten, though the id
// that opened it left and was forgotten: the long-lived member keeps its
// chunks. Once its last member leaves, the namespace goes with that
// member's id (else it stayed for the boot), and may be opened again with
// another geometry.
func TestANamespaceWithAMemberOutlivesItsOpener(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.MaxEngines = 2 }) // 32 namespaces at once
	opener := e.newEngine("opener", defaultOpts())
	opener.spec.Namespace = "shared"
	opener.register()
	long := e.newEngine("long", defaultOpts())
	long.spec.Namespace = "shared"
	long.register()
	opener.unregister()
	long.fill(0, 3, 7)
	want := bytes.Clone(long.block(0, 3))
	long.storeOne("kept", 3)

	churn(t, e, "pod", 40)
	r := long.loadInto("load", []string{hash("kept", 0)}, 4, []int{6})
	require.True(t, r.OK, r.Error)
	require.Equal(t, want, long.block(0, 6))

	long.unregister()
	churn(t, e, "later", 40)
	require.LessOrEqual(t, e.node.NamespacesHeld(), 32)
	// Gone with long's id: "shared" is opened again, with another geometry.
	o := defaultOpts()
	o.blockBytes = 512
	next := e.newEngine("next", o)
	next.spec.Namespace = "shared"
	next.register()
}

// On a cluster, a namespace forgotten with the id that opened it is told
// to the other nodes (an AllBlocksCleared CPU of it, on that id): they
// stop counting the node's chunks of it, which it no longer serves (its
// keys in the pool are unreachable), and its key set, which they read
// again, lists none. Else another node kept counting them (its lookup
// timed out meanwhile here), its loads fetching misses.
func TestClusterAForgottenNamespaceIsNoLongerCountedElsewhere(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2, func(i int, c *node.Config) {
		if i == 0 {
			c.MaxEngines = 1 // 16 namespaces at once
		}
	})
	settle := n0Beats(t, kc)
	a, b, hs := prefixSeenAcross(t, kc, "rc")
	a.unregister()
	for i := range 16 { // ea (first departed) forgotten to make room, "m" on n0 with it
		te := kc.engineOn(0, fmt.Sprintf("pod%d", i), "")
		te.register()
		te.unregister()
	}
	awaitLookup(t, b, hs, 0, "B of A's prefix in a namespace n0 forgot")
	settle() // the catch-up of n0's key set that the clear asked for: it lists none of them
	require.Equal(t, 0, b.lookup(hs))
}
