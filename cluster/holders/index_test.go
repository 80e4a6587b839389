package holders

import (
	"encoding/hex"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvactors/kvactors/messages"
	"github.com/stretchr/testify/require"
)

var (
	t0    = time.Unix(1_000_000, 0)
	lease = 10 * time.Second
)

func stored(ns string, group int, hashes ...string) messages.KVEvent {
	return messages.KVEvent{Type: messages.KVBlockStored, BlockHashes: hashes, GroupIdx: group, Medium: messages.MediumCPU, Namespace: ns}
}

func removed(ns string, group int, hashes ...string) messages.KVEvent {
	ev := stored(ns, group, hashes...)
	ev.Type = messages.KVBlockRemoved
	return ev
}

func batch(evs ...messages.KVEvent) messages.KVEventBatch { return messages.KVEventBatch{Events: evs} }

func key(t *testing.T, h string, g int) messages.Key {
	raw, err := hex.DecodeString(h)
	require.NoError(t, err)
	return KeyOf(raw, g)
}

func apply(t *testing.T, x *Index, node, boot string, evs ...messages.KVEvent) {
	t.Helper()
	_, err := x.applyPlain(node, boot, "e-"+node, batch(evs...))
	require.NoError(t, err)
}

func TestHoldersPerNamespaceAndGroup(t *testing.T) {
	x := New(lease)
	_, err := x.Heartbeat("a", "a1", t0)
	require.NoError(t, err)
	_, err = x.Heartbeat("b", "b1", t0)
	require.NoError(t, err)
	apply(t, x, "a", "a1", stored("m", 0, "aa", "bb"), stored("m", 1, "aa"))
	apply(t, x, "b", "b1", stored("m", 0, "bb"), stored("other", 0, "cc"))

	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 1), t0))
	require.Equal(t, []string{"a", "b"}, x.Holders(".m", key(t, "bb", 0), t0))
	// Namespaces never match (PROTOCOL.md Isolation: lookup is per namespace).
	require.Empty(t, x.Holders(".m", key(t, "cc", 0), t0))
	require.Equal(t, []string{"b"}, x.Holders(".other", key(t, "cc", 0), t0))
	require.True(t, x.HeldElsewhere(".m", key(t, "bb", 0), "a", t0))
	require.False(t, x.HeldElsewhere(".m", key(t, "aa", 0), "a", t0))

	apply(t, x, "a", "a1", removed("m", 0, "bb"))
	require.Equal(t, []string{"b"}, x.Holders(".m", key(t, "bb", 0), t0))
}

// An event without a namespace is in the engine's namespace (the default).
func TestNamespaceDefaultsToTheEngine(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	_, err := x.applyPlain("a", "a1", "e7", batch(stored("", 0, "aa")))
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, x.Holders("e7", key(t, "aa", 0), t0))
}

// An engine's own namespace (named by default or outright, announced on its
// own kv_events) is not the shared namespace of that name another engine
// announces: a squatter naming engine vic's id as its namespace never
// counts vic's keys, nor vic the squatter's (messages.NamespaceKey).
func TestAnEnginesOwnNamespaceIsNotASharedOneOfItsName(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	_, _ = x.Heartbeat("b", "b1", t0)
	_, err := x.applyPlain("a", "a1", "vic", batch(stored("vic", 0, "aa"), stored("", 0, "bb")))
	require.NoError(t, err)
	_, err = x.applyPlain("b", "b1", "mal", batch(stored("vic", 0, "cc")))
	require.NoError(t, err)
	own, shared := messages.NamespaceKey("vic", ""), messages.NamespaceKey("mal", "vic")
	require.NotEqual(t, own, shared)
	require.Equal(t, []string{"a"}, x.Holders(own, key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(own, key(t, "bb", 0), t0))
	require.Empty(t, x.Holders(own, key(t, "cc", 0), t0))
	require.Equal(t, []string{"b"}, x.Holders(shared, key(t, "cc", 0), t0))
	require.Empty(t, x.Holders(shared, key(t, "aa", 0), t0))
}

// Only host memory counts: a node's disk-tier events (medium DISK) neither
// add nor remove a holder, since fetches are served from host memory.
func TestDiskTierEventsAreSkipped(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	disk := func(ev messages.KVEvent) messages.KVEvent { ev.Medium = messages.MediumDisk; return ev }
	apply(t, x, "a", "a1", stored("m", 0, "aa"), disk(stored("m", 0, "bb")))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))
	require.Empty(t, x.Holders(".m", key(t, "bb", 0), t0), "on disk only: not fetchable")
	apply(t, x, "a", "a1", disk(removed("m", 0, "aa")))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0), "a disk deletion leaves host memory's copy")
}

// "A node that is gone stops counting as a holder within lease_ms."
func TestSilentNodeStopsCountingWithinTheLease(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa"))
	k := key(t, "aa", 0)
	require.Equal(t, []string{"a"}, x.Holders(".m", k, t0.Add(lease-time.Millisecond)))
	require.Empty(t, x.Holders(".m", k, t0.Add(lease)))
	require.Equal(t, []string{"a"}, x.Expire(t0.Add(lease)))
	require.Empty(t, x.Nodes(t0.Add(lease)))
	require.Equal(t, uint64(1), x.Stats().Expired)
	// It comes back: new to the index, so it must be caught up.
	need, err := x.Heartbeat("a", "a1", t0.Add(2*lease))
	require.NoError(t, err)
	require.True(t, need)
	require.Empty(t, x.Holders(".m", k, t0.Add(2*lease)))
}

// A new boot drops everything the old process held, at once; a late
// message of the old boot changes nothing.
func TestNewBootDropsTheOldBootsKeysAndRetiresIt(t *testing.T) {
	x := New(lease)
	need, _ := x.Heartbeat("a", "a1", t0)
	require.True(t, need, "a new node is caught up")
	need, _ = x.Heartbeat("a", "a1", t0.Add(time.Second))
	require.False(t, need, "a steady node is not")
	apply(t, x, "a", "a1", stored("m", 0, "aa"))
	need, err := x.Heartbeat("a", "a2", t0.Add(2*time.Second))
	require.NoError(t, err)
	require.True(t, need)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0.Add(2*time.Second)))

	_, err = x.applyPlain("a", "a1", "e", batch(stored("m", 0, "bb")))
	require.ErrorIs(t, err, ErrStaleBoot)
	_, err = x.Heartbeat("a", "a1", t0.Add(3*time.Second))
	require.ErrorIs(t, err, ErrStaleBoot)
	require.Empty(t, x.Holders(".m", key(t, "bb", 0), t0.Add(3*time.Second)))
	require.Equal(t, "a2", x.Nodes(t0)[0].Boot)
	require.Equal(t, uint64(2), x.Stats().Stale)
}

func TestAllBlocksClearedDropsTheNodesKeys(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa"), stored("n", 0, "bb"))
	cleared, err := x.applyPlain("a", "a1", "e", batch(messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumCPU}, stored("m", 0, "cc")))
	require.NoError(t, err)
	require.True(t, cleared)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0))
	require.Empty(t, x.Holders(".n", key(t, "bb", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "cc", 0), t0), "events after the clear apply")
}

// Bad input: a clear error, counted, nothing else changed.
func TestMalformedBatchChangesNothing(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	for _, b := range []messages.KVEventBatch{
		batch(stored("m", 0, "aa"), stored("m", 0, "zz")),
		batch(stored("m", 0, "aa"), stored("m", 0, "")),
		batch(stored("m", 0, "aa"), stored("m", -1, "bb")),
		batch(stored("m", 0, "aa"), messages.KVEvent{Type: "BlockEaten"}),
	} {
		_, err := x.applyPlain("a", "a1", "e", b)
		require.ErrorIs(t, err, ErrBadEvent)
	}
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, uint64(4), x.Stats().Rejected)
}

// A page read before a removal must not bring the removed key back.
func TestCatchUpPageLosesToARemovalSeenMeanwhile(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	id, err := x.BeginCatchUp("a", "a1")
	require.NoError(t, err)
	apply(t, x, "a", "a1", removed("m", 0, "aa"))
	apply(t, x, "a", "a1", stored("m", 0, "cc"), removed("m", 0, "cc"), stored("m", 0, "cc"))
	page := []NSKey{{".m", key(t, "aa", 0)}, {".m", key(t, "bb", 0)}, {".m", key(t, "cc", 0)}}
	require.NoError(t, x.CatchUpPage("a", id, page))
	x.EndCatchUp("a", id)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "bb", 0), t0))
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "cc", 0), t0), "re-stored after the removal")
	require.ErrorIs(t, x.CatchUpPage("a", id, page), ErrNoSync, "an ended catch-up takes no page")

	// A superseded catch-up's pages are refused.
	old, _ := x.BeginCatchUp("a", "a1")
	cur, _ := x.BeginCatchUp("a", "a1")
	require.ErrorIs(t, x.CatchUpPage("a", old, page), ErrNoSync)
	require.NoError(t, x.CatchUpPage("a", cur, nil))
	// And one from before a reboot too.
	_, _ = x.Heartbeat("a", "a2", t0)
	require.ErrorIs(t, x.CatchUpPage("a", cur, page), ErrNoSync)
}

// A finished catch-up replaces the node's keys with what its pages listed
// and what kv_events stored meanwhile: a key evicted while its
// BlockRemoved was missed goes; a failed one changes nothing.
func TestFinishedCatchUpDropsTheKeysItDidNotList(t *testing.T) {
	x := New(lease)
	_, _ = x.Heartbeat("a", "a1", t0)
	apply(t, x, "a", "a1", stored("m", 0, "aa", "bb", "dd"))
	id, err := x.BeginCatchUp("a", "a1")
	require.NoError(t, err)
	require.NoError(t, x.CatchUpPage("a", id, []NSKey{{".m", key(t, "bb", 0)}}))
	apply(t, x, "a", "a1", stored("m", 0, "cc")) // stored after the page was read
	apply(t, x, "a", "a1", stored("m", 0, "dd")) // a store event for a key held before
	x.EndCatchUp("a", id)                        // failed: nothing dropped
	require.Equal(t, []string{"a"}, x.Holders(".m", key(t, "aa", 0), t0))

	id, err = x.BeginCatchUp("a", "a1")
	require.NoError(t, err)
	require.NoError(t, x.CatchUpPage("a", id, []NSKey{{".m", key(t, "bb", 0)}}))
	apply(t, x, "a", "a1", stored("m", 0, "cc"), stored("m", 0, "dd"))
	x.FinishCatchUp("a", id)
	require.Empty(t, x.Holders(".m", key(t, "aa", 0), t0), "evicted while its BlockRemoved was missed")
	for _, h := range []string{"bb", "cc", "dd"} {
		require.Equal(t, []string{"a"}, x.Holders(".m", key(t, h, 0), t0), h)
	}
	require.Equal(t, 3, x.Nodes(t0)[0].Keys)
	x.FinishCatchUp("a", id) // once only
	require.Equal(t, 3, x.Nodes(t0)[0].Keys)
}

func TestKeyOfAppendsTheGroupBigEndian(t *testing.T) {
	require.Equal(t, messages.Key("\xab\x00\x00\x01\x02"), KeyOf([]byte{0xab}, 258))
}

func TestImportsOnlyTheStandardLibraryAndMessages(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	require.NoError(t, err)
	for _, dep := range strings.Fields(string(out)) {
		require.Contains(t, []string{"github.com/kvactors/kvactors/cluster/holders", "github.com/kvactors/kvactors/messages"}, dep)
	}
}

// applyPlain is ApplyKVEvents with namespaces keyed by messages.NamespaceKey
// alone (no geometry): the index's rules do not depend on how a namespace
// is keyed, and the tests name namespaces plainly.
func (x *Index) applyPlain(nodeID, boot, engine string, b messages.KVEventBatch) (bool, error) {
	return x.applyKVEvents(nodeID, boot, func(name string) string { return messages.NamespaceKey(engine, name) }, b)
}
