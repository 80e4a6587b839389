package node

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// The journal publishes records in the order they were added: consecutive
// records for one engine share a message (up to kvMessageHashes hashes), a
// change of engine starts a new one, keys of a namespace with no engine
// are not announced, and close publishes what was added before it and
// nothing after.
func TestKVJournalOrderAndCoalescing(t *testing.T) {
	type msg struct {
		engine string
		events []messages.KVEvent
	}
	var mu sync.Mutex
	var got []msg
	emit := func(engine string, events []messages.KVEvent) {
		mu.Lock()
		defer mu.Unlock()
		kept := make([]messages.KVEvent, len(events))
		for i, e := range events { // hashes are the journal's until emit returns
			e.BlockHashes = append([]string(nil), e.BlockHashes...)
			kept[i] = e
		}
		got = append(got, msg{engine, kept})
	}
	// Namespace 1 is "m" with engines ea (the default) and eb; 2 has none.
	target := func(engineID string, ns sched.NamespaceID) (string, string) {
		switch {
		case ns != 1:
			return "", ""
		case engineID == "eb":
			return "m", "eb"
		}
		return "m", "ea"
	}
	key := func(ns sched.NamespaceID, h string) messages.Key {
		return messages.Key(sched.AppendKey(nil, ns, messages.Hash(h), 0))
	}
	j := newKVJournal(emit, target)
	// Before start: kept, in order.
	j.pool(true, []messages.Key{key(1, "a")}, "ea")
	j.pool(false, []messages.Key{key(1, "b"), key(2, "secret")}, "ea")
	j.add("eb", messages.KVBlockStored, messages.MediumDisk, []messages.Key{key(1, "b")})
	j.pool(true, []messages.Key{key(1, "c")}, "ea")
	require.Equal(t, 4, j.pending(), "queued before start (the gauge)")
	j.start()
	j.close()
	require.Zero(t, j.pending())
	j.pool(true, []messages.Key{key(1, "late")}, "ea")

	hx := func(s string) string { return fmt.Sprintf("%x", s) }
	ev := func(typ, medium string, hs ...string) messages.KVEvent {
		for i := range hs {
			hs[i] = hx(hs[i])
		}
		return messages.KVEvent{Type: typ, Medium: medium, Namespace: "m", BlockHashes: hs}
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []msg{
		{"ea", []messages.KVEvent{ev(messages.KVBlockStored, messages.MediumCPU, "a"),
			ev(messages.KVBlockRemoved, messages.MediumCPU, "b")}},
		{"eb", []messages.KVEvent{ev(messages.KVBlockStored, messages.MediumDisk, "b")}},
		{"ea", []messages.KVEvent{ev(messages.KVBlockStored, messages.MediumCPU, "c")}},
	}, got, "one message per run of one engine; namespace 2's key and the late record not announced")
}

// A long run of one engine is cut into messages of at most
// kvMessageHashes hashes, in order, even inside one record (a long-context
// job's thousands of chunks): a message past NATS' max_payload would be
// refused whole.
func TestKVJournalSplitsLongRuns(t *testing.T) {
	var sizes []int
	var order []string
	emit := func(_ string, events []messages.KVEvent) {
		n := 0
		for _, e := range events {
			n += len(e.BlockHashes)
			for _, h := range e.BlockHashes {
				order = append(order, strings.Clone(h))
			}
		}
		sizes = append(sizes, n)
	}
	j := newKVJournal(emit, func(string, sched.NamespaceID) (string, string) { return "m", "ea" })
	var want []string
	record := func(r, n int) {
		keys := make([]messages.Key, n)
		for i := range keys {
			h := fmt.Sprintf("%04d%05d", r, i)
			keys[i] = messages.Key(sched.AppendKey(nil, 1, messages.Hash(h), 0))
			want = append(want, fmt.Sprintf("%x", h))
		}
		j.pool(true, keys, "ea")
	}
	for r := range 4095 {
		record(r, 1)
	}
	record(9999, 20_000) // one record past several messages' worth
	j.start()
	j.close()
	require.Equal(t, want, order, "every hash once, in order")
	total := 0
	for i, n := range sizes {
		total += n
		if i < len(sizes)-1 {
			require.Equal(t, kvMessageHashes, n, "message %d is cut exactly at the bound", i)
		}
	}
	require.LessOrEqual(t, sizes[len(sizes)-1], kvMessageHashes)
	require.Equal(t, 4095+20_000, total)
}
