package node

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/wire"
)

// The journal publishes records in the order they were added: consecutive
// records for one engine share a message (up to about kvMessageBytes), a
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
	require.Zero(t, j.pending(), "a record added after close is dropped, not kept")

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

// A long run of one engine is cut into messages that each encode under
// kvMessageBytes, in order, even inside one record (a long-context job's
// thousands of chunks), and so does the worst case for the envelope: one
// single-key record after another, each event naming the longest namespace
// with the longest default hash. A message past NATS' max_payload would be
// refused whole.
func TestKVJournalCutsMessagesUnderTheBound(t *testing.T) {
	ns := strings.Repeat("n", 128) // PROTOCOL.md: a namespace is 1..128 bytes
	for _, tc := range []struct {
		name    string
		records []int // keys per record
	}{
		{"a huge record after many small ones", append(make([]int, 4095), 20_000)},
		{"single keys in alternating groups", make([]int, 12_000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var sizes []int
			var order []string
			emit := func(_ string, events []messages.KVEvent) {
				for _, e := range events {
					for _, h := range e.BlockHashes {
						order = append(order, strings.Clone(h))
					}
				}
				sizes = append(sizes, len(wire.AppendKVEvents(nil, &messages.KVEventBatch{TS: 1e9, Events: events})))
			}
			j := newKVJournal(emit, func(string, sched.NamespaceID) (string, string) { return ns, "ea" })
			var want []string
			for r, n := range tc.records {
				keys := make([]messages.Key, max(n, 1))
				for i := range keys {
					h := fmt.Sprintf("%016d%016d", r, i) // 32 bytes: 64 hex characters
					keys[i] = messages.Key(sched.AppendKey(nil, 1, messages.Hash(h), r%2))
					want = append(want, fmt.Sprintf("%x", h))
				}
				j.pool(r%3 == 0, keys, "ea")
			}
			j.start()
			j.close()
			require.Equal(t, want, order, "every hash once, in order")
			require.Greater(t, len(sizes), 2, "cut into several messages")
			for i, n := range sizes {
				require.LessOrEqual(t, n, kvMessageBytes+256, "message %d: %d bytes", i, n)
			}
		})
	}
}
