package actors_test

import (
	"encoding/hex"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Keys of two namespaces and two groups, interleaved: one event per
// (namespace, group) in first-seen order, each namespace's events handed
// over once, apart from the other's, with every hash exactly once.
func TestKeyEventsGroupsByNamespaceThenGroup(t *testing.T) {
	key := func(ns sched.NamespaceID, h string, g int) messages.Key {
		return messages.Key(sched.AppendKey(nil, ns, messages.Hash(h), g))
	}
	hx := func(s string) string { return hex.EncodeToString([]byte(s)) }
	keys := []messages.Key{key(7, "a", 0), key(9, "x", 1), key(7, "b", 1), key(7, "c", 0), key(9, "y", 1)}
	type call struct {
		ns     sched.NamespaceID
		events []messages.KVEvent
	}
	var got []call
	var ke actors.KeyEvents
	for range 2 { // the scratch is reused: a second call gives the same answer
		got = got[:0]
		ke.Group(keys, messages.KVBlockRemoved, messages.MediumCPU, func(ns sched.NamespaceID, ev []messages.KVEvent) {
			got = append(got, call{ns, ev})
		})
		ev := func(g int, hs ...string) messages.KVEvent {
			return messages.KVEvent{Type: messages.KVBlockRemoved, GroupIdx: g, Medium: messages.MediumCPU, BlockHashes: hs}
		}
		require.Equal(t, []call{
			{7, []messages.KVEvent{ev(0, hx("a"), hx("c")), ev(1, hx("b"))}},
			{9, []messages.KVEvent{ev(1, hx("x"), hx("y"))}},
		}, got)
	}
	// One namespace (the usual case): one call with every group's event.
	got = got[:0]
	ke.Group([]messages.Key{key(7, "a", 1), key(7, "b", 0), key(7, "c", 1)}, messages.KVBlockStored, messages.MediumDisk,
		func(ns sched.NamespaceID, ev []messages.KVEvent) { got = append(got, call{ns, ev}) })
	require.Equal(t, []call{{7, []messages.KVEvent{
		{Type: messages.KVBlockStored, GroupIdx: 1, Medium: messages.MediumDisk, BlockHashes: []string{hx("a"), hx("c")}},
		{Type: messages.KVBlockStored, GroupIdx: 0, Medium: messages.MediumDisk, BlockHashes: []string{hx("b")}},
	}}}, got)
	ke.Group(nil, messages.KVBlockStored, messages.MediumDisk, func(sched.NamespaceID, []messages.KVEvent) {
		t.Fatal("no keys: nothing to emit")
	})
}
