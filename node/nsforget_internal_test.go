package node

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A namespace forgotten leaves a hole in the ids (never given out again):
// a resync still clears every namespace held past it, and a forgotten
// one's deferred kv_events are dropped (no engine joins it again).
func TestKVJournalOfForgottenNamespaces(t *testing.T) {
	var mu sync.Mutex
	var got []string
	emit := func(engine string, _ uint64, body []byte) {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range decodeKV(t, body) {
			got = append(got, engine+" "+ev.Type+" "+ev.Namespace+" "+ev.Medium)
		}
	}
	var forgotten sync.Map
	target := func(_ string, ns sched.NamespaceID) (string, string, string, uint64) {
		if _, gone := forgotten.Load(ns); gone {
			return "", "", "", 0
		}
		switch ns {
		case 1:
			return "a", ".a", "", 0x11 // no member: its changes deferred
		case 2:
			return "b", ".b", "eb", 0x22
		}
		return "", "", "", 0
	}
	j := newKVJournal(emit, target)
	j.held = func() []sched.NamespaceID { return []sched.NamespaceID{1, 2} } // 1 forgotten meanwhile
	deferred := make(chan struct{}, 1)
	j.onDefer = func(int, int) { deferred <- struct{}{} }
	j.start()
	j.pool(true, []messages.Key{messages.Key(sched.AppendKey(nil, 1, messages.Hash("x"), 0))}, "ea")
	<-deferred // before namespace 1 is forgotten
	forgotten.Store(sched.NamespaceID(1), true)
	j.forgot("ea", &namespace{id: 1, name: "a", key: ".a", geo: 0x11})
	j.resync()
	j.close()
	require.False(t, j.deferred.has(1), "a forgotten namespace's deferred changes kept")
	require.Zero(t, j.deferred.held)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"eb AllBlocksCleared b CPU", "eb AllBlocksCleared b DISK"}, got)
}

// A forgotten namespace's disk mapping goes with it; the same name and
// geometry opened again under a new id maps its chunks on disk to that id,
// and forgetting the old one again leaves the new mapping be.
func TestDiskKeysForgetANamespace(t *testing.T) {
	d := newDiskKeys()
	lay := &sched.Layout{TokensPerHash: 4, BlocksPerChunk: 1}
	d.learn(1, "ns", lay)
	k1 := messages.Key(sched.AppendKey(nil, 1, messages.Hash("h"), 0))
	onDisk, ok := d.ToDisk(k1)
	require.True(t, ok)
	d.forget(1)
	_, ok = d.ToDisk(k1)
	require.False(t, ok, "a forgotten namespace's keys still reach the disk")
	_, ok = d.FromDisk(onDisk)
	require.False(t, ok, "a forgotten namespace's chunks on disk still map to its id")
	_, first := d.learn(2, "ns", lay)
	require.True(t, first)
	back, ok := d.FromDisk(onDisk)
	require.True(t, ok)
	require.Equal(t, messages.Key(sched.AppendKey(nil, 2, messages.Hash("h"), 0)), back)
	require.Len(t, d.byID, 1)

	// 1 forgotten only once 2 has its prefix: 2 keeps it.
	d = newDiskKeys()
	d.learn(1, "ns", lay)
	d.learn(2, "ns", lay)
	d.forget(1)
	back, ok = d.FromDisk(onDisk)
	require.True(t, ok)
	require.Equal(t, messages.Key(sched.AppendKey(nil, 2, messages.Hash("h"), 0)), back)
}
