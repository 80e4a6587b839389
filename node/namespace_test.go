package node_test

import (
	"bytes"
	"fmt"
	"testing"

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
	require.Contains(t, reply.Error, `engine "mal" opened 16 namespaces in this boot`)
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
