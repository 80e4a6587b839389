package node_test

import (
	"path/filepath"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// An engine opening a namespace on a node with a disk tier is sent that
// namespace's AllBlocksCleared DISK (PROTOCOL.md "kv_events", restart);
// the other nodes keep counting every other tenant's chunks of that node
// and read none of its key set again. Before, their feeds took it for a
// clear of the node's host memory: any engine re-registering into new
// namespaces (16 a boot) had every other node drop all of that node's keys
// and page its whole set again (red team).
func TestClusterADiskClearOfANewNamespaceDropsNoOtherTenantsHolders(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	kc := startCluster(t, 2, func(i int, c *node.Config) {
		c.DiskDir, c.DiskBytes = filepath.Join(base, strconv.Itoa(i)), 1<<20
	})
	settle := n0Beats(t, kc)

	mal := kc.engineOn(0, "mal", "")
	mal.register()
	_, _, hs := prefixSeenAcross(t, kc, "dc")
	settle()
	catchUps := kc.nodes[1].counter("kvactors_cluster_holders_catchups_total", "")

	fresh := mal.spec
	fresh.Namespace = "fresh"
	require.Contains(t, string(mal.request("register", fresh)), `"ok":true`)
	for cleared := false; !cleared; {
		for _, ev := range recv(t, mal.kv, "mal's DISK clear of namespace fresh").Events {
			cleared = cleared || (ev.Type == messages.KVAllBlocksCleared && ev.Medium == messages.MediumDisk && ev.Namespace == "fresh")
		}
	}
	// A clear taken for the node's would be caught up at n0's next
	// heartbeat: three of them leave it time to end.
	settle()
	require.Equal(t, catchUps, kc.nodes[1].counter("kvactors_cluster_holders_catchups_total", ""),
		"n1 read n0's key set again after a DISK clear")
	// b has expired meanwhile (silent for the heartbeats waited for): a
	// new engine of m on n1 counts the prefix at once.
	probe := kc.engineOn(1, "ep", "m")
	probe.register()
	require.Equal(t, 8, probe.lookup(hs), "n1 still counts A's prefix")
}

// An engine's first register in a boot publishes the contract's
// AllBlocksCleared CPU, which names no namespace (PROTOCOL.md v2 "Register
// reply"): the node's pool is as it was. The other nodes keep counting
// every other tenant's chunks of that node and read none of its key set
// again. Before, any engine registering on a node had every other node
// drop all of that node's keys, every tenant's, until the catch-up at its
// next heartbeat (red team).
func TestClusterAnEnginesFirstRegisterDropsNoOtherTenantsHolders(t *testing.T) {
	t.Parallel()
	kc := startCluster(t, 2)
	settle := n0Beats(t, kc)

	px := kc.engineOn(1, "px", "x")
	px.register()
	_, b, hs := prefixSeenAcross(t, kc, "rc")
	settle() // before the fix: the catch-ups of n0 that ea's register caused
	beat(t, b, px)
	catchUps := kc.nodes[1].counter("kvactors_cluster_holders_catchups_total", "")

	mal := kc.engineOn(0, "mal", "x")
	mal.register() // checks that its AllBlocksCleared came first
	xs := []string{hash("rx", 0), hash("rx", 1)}
	mal.storePrefix("rx", xs, 40, 41, 3, "stored by mal in namespace x")
	// n1 counts mal's prefix: it has applied the clear before it.
	awaitLookup(t, px, xs, 8, "n1 of mal's prefix")
	require.Equal(t, 8, b.lookup(hs), "n1 still counts A's prefix in m after mal's register")
	settle()
	require.Equal(t, catchUps, kc.nodes[1].counter("kvactors_cluster_holders_catchups_total", ""),
		"n1 read n0's key set again after an engine's first register")
}

// n0Beats returns a wait for three of n0's heartbeats from now: long
// enough for any catch-up of n0 that n1 has to make to end (one starts at
// a heartbeat).
func n0Beats(t *testing.T, kc *kvCluster) (settle func()) {
	t.Helper()
	beats := make(chan *nats.Msg, 64)
	sub, err := kc.nodes[0].nc.ChanSubscribe("kvactors._node.n0.heartbeat", beats)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, kc.nodes[0].nc.Flush())
	return func() {
		for range 3 {
			recv(t, beats, "n0's heartbeat")
		}
	}
}
