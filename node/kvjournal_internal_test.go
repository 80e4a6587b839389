package node

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/quick"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// decodeKV decodes a kv_events body as a router would, failing the test on
// anything but valid JSON of that shape.
func decodeKV(t *testing.T, body []byte) []messages.KVEvent {
	t.Helper()
	var b messages.KVEventBatch
	d := json.NewDecoder(bytes.NewReader(body))
	d.DisallowUnknownFields()
	require.NoError(t, d.Decode(&b), "%s", body)
	_, err := d.Token()
	require.ErrorIs(t, err, io.EOF, "nothing after the JSON value: %s", body)
	require.Positive(t, b.TS)
	return b.Events
}

// The journal publishes records in the order they were added: consecutive
// records for one engine share a message (up to about kvMessageBytes), a
// change of engine starts a new one, keys of a namespace with no engine
// are not announced, and close publishes what was added before it and
// nothing after.
func TestKVJournalOrderAndCoalescing(t *testing.T) {
	type msg struct {
		engine string
		geo    uint64
		events []messages.KVEvent
	}
	var mu sync.Mutex
	var got []msg
	emit := func(engine string, geo uint64, body []byte) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, msg{engine, geo, decodeKV(t, body)})
	}
	// Namespace 1 is "m" (geometry 0x11) with engines ea (the default) and
	// eb; 2 has none; 3 is "n" (geometry 0x33), last registered by ea; 4 is
	// "o" (geometry 0x44), whose engines have all left.
	target := func(engineID string, ns sched.NamespaceID) (string, string, string, uint64) {
		switch {
		case ns == 3:
			return "n", ".n", "ea", 0x33
		case ns == 4:
			return "o", ".o", "", 0x44
		case ns != 1:
			return "", "", "", 0
		case engineID == "eb":
			return "m", ".m", "eb", 0x11
		}
		return "m", ".m", "ea", 0x11
	}
	key := func(ns sched.NamespaceID, h string) messages.Key {
		return messages.Key(sched.AppendKey(nil, ns, messages.Hash(h), 0))
	}
	j := newKVJournal(emit, target)
	type seen struct {
		typ, medium, ns string
		keys            []messages.Key
	}
	var observed []seen // the cluster's key set sees what is announced, nothing else
	j.observe = func(typ, medium, ns string, keys []messages.Key) {
		observed = append(observed, seen{typ, medium, ns, slices.Clone(keys)})
	}
	// Before start: kept, in order.
	j.pool(true, []messages.Key{key(1, "a")}, "ea")
	j.pool(false, []messages.Key{key(1, "b"), key(2, "secret")}, "ea")
	j.add("eb", messages.KVBlockStored, messages.MediumDisk, []messages.Key{key(1, "b")})
	j.pool(true, []messages.Key{key(1, "c"), key(3, "d")}, "ea")
	j.pool(false, []messages.Key{key(4, "left")}, "ea")
	require.Equal(t, 5, j.pending(), "queued before start (the gauge)")
	j.start()
	j.close()
	require.Zero(t, j.pending())
	j.pool(true, []messages.Key{key(1, "late")}, "ea")
	require.Zero(t, j.pending(), "a record added after close is dropped, not kept")

	hx := func(s string) string { return fmt.Sprintf("%x", s) }
	evIn := func(ns, typ, medium string, hs ...string) messages.KVEvent {
		for i := range hs {
			hs[i] = hx(hs[i])
		}
		return messages.KVEvent{Type: typ, Medium: medium, Namespace: ns, BlockHashes: hs}
	}
	ev := func(typ, medium string, hs ...string) messages.KVEvent { return evIn("m", typ, medium, hs...) }
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []msg{
		{"ea", 0x11, []messages.KVEvent{ev(messages.KVBlockStored, messages.MediumCPU, "a"),
			ev(messages.KVBlockRemoved, messages.MediumCPU, "b")}},
		{"eb", 0x11, []messages.KVEvent{ev(messages.KVBlockStored, messages.MediumDisk, "b")}},
		{"ea", 0x11, []messages.KVEvent{ev(messages.KVBlockStored, messages.MediumCPU, "c")}},
		{"ea", 0x33, []messages.KVEvent{evIn("n", messages.KVBlockStored, messages.MediumCPU, "d")}},
	}, got, "one message per run of one engine and one geometry (its Kvactors-Geometry); namespace 2's and 4's keys and the late record not announced")
	m, n, o := messages.ClusterNamespace(".m", 0x11), messages.ClusterNamespace(".n", 0x33), messages.ClusterNamespace(".o", 0x44)
	require.Equal(t, []seen{
		{messages.KVBlockStored, messages.MediumCPU, m, []messages.Key{key(1, "a")}},
		{messages.KVBlockRemoved, messages.MediumCPU, m, []messages.Key{key(1, "b")}},
		{messages.KVBlockStored, messages.MediumDisk, m, []messages.Key{key(1, "b")}},
		{messages.KVBlockStored, messages.MediumCPU, m, []messages.Key{key(1, "c")}},
		{messages.KVBlockStored, messages.MediumCPU, n, []messages.Key{key(3, "d")}},
		{messages.KVBlockRemoved, messages.MediumCPU, o, []messages.Key{key(4, "left")}},
	}, observed, "observed in order, keyed as the shared namespace m (messages.NamespaceKey) of its geometry (messages.ClusterNamespace); namespace 4's, announced to no one, still follows the pool; namespace 2's, no namespace of the boot, is not")
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
			emit := func(_ string, _ uint64, body []byte) {
				for _, e := range decodeKV(t, body) {
					order = append(order, e.BlockHashes...)
				}
				sizes = append(sizes, len(body))
			}
			j := newKVJournal(emit, func(string, sched.NamespaceID) (string, string, string, uint64) { return ns, "." + ns, "ea", 1 })
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
				require.LessOrEqual(t, n, kvMessageBytes, "message %d: %d bytes", i, n)
			}
		})
	}
}

// Messages are cut exactly: none passes kvMessageBytes, and none but the
// last is short of it by more than the next event would have needed
// (records of random hash lengths, so the cuts land everywhere, and at
// least once within a few bytes of the bound).
func TestKVJournalFillsMessagesToTheBound(t *testing.T) {
	t.Parallel()
	var sizes []int
	var hashes int
	emit := func(_ string, _ uint64, body []byte) {
		for _, e := range decodeKV(t, body) {
			hashes += len(e.BlockHashes)
		}
		sizes = append(sizes, len(body))
	}
	ns := "llama-70b"
	j := newKVJournal(emit, func(string, sched.NamespaceID) (string, string, string, uint64) { return ns, "." + ns, "ea", 1 })
	rng := rand.New(rand.NewPCG(1, 2))
	want := 0
	for r := range 40_000 {
		keys := make([]messages.Key, 1+rng.IntN(20))
		for i := range keys {
			h := make([]byte, 1+rng.IntN(70))
			for k := range h {
				h[k] = byte(rng.IntN(256))
			}
			keys[i] = messages.Key(sched.AppendKey(nil, 1, messages.Hash(h), r%3))
		}
		want += len(keys)
		j.pool(rng.IntN(2) == 0, keys, "ea")
	}
	j.start()
	j.close()
	require.Equal(t, want, hashes, "every hash once")
	require.Greater(t, len(sizes), 50)
	// The most one event adds: a comma, its head, one 70-byte hash (140
	// hex and 3), and its tail with the namespace.
	maxEvent := len(`,{"type":"BlockRemoved","block_hashes":[`) + 143 +
		len(`],"group_idx":2,"medium":"CPU","namespace":""}`) + len(ns)
	close := 0
	for i, n := range sizes {
		require.LessOrEqual(t, n, kvMessageBytes, "message %d", i)
		if i < len(sizes)-1 {
			require.Greater(t, n, kvMessageBytes-maxEvent, "message %d is cut early", i)
		}
		if n > kvMessageBytes-8 {
			close++
		}
	}
	require.Positive(t, close, "some message ends within 8 bytes of the bound")
}

// Keys of two namespaces and two groups, interleaved: one run per
// (namespace, group), a namespace's runs together, namespaces and each
// one's groups in first-seen order, every key once. The scratch is reused:
// a second call gives the same answer.
func TestKeySplitGroupsByNamespaceThenGroup(t *testing.T) {
	key := func(ns sched.NamespaceID, h string, g int) messages.Key {
		return messages.Key(sched.AppendKey(nil, ns, messages.Hash(h), g))
	}
	keys := []messages.Key{key(7, "a", 1), key(9, "x", 1), key(7, "b", 0), key(7, "c", 1), key(9, "y", 1)}
	var s keySplit
	for range 2 {
		var got []keyRun
		for run := range s.runs(keys) {
			run.keys = slices.Clone(run.keys)
			got = append(got, run)
		}
		require.Equal(t, []keyRun{
			{ns: 7, group: 1, keys: []messages.Key{keys[0], keys[3]}},
			{ns: 7, group: 0, keys: []messages.Key{keys[2]}},
			{ns: 9, group: 1, keys: []messages.Key{keys[1], keys[4]}},
		}, got, "group 1 was seen first in namespace 7")
	}
	for range s.runs(nil) {
		t.Fatal("no keys: no run")
	}
}

// For any keys: the runs hold each key once, each run one (namespace,
// group) with its keys in their original order, no (namespace, group)
// twice, and a namespace's runs next to each other.
func TestKeySplitProperties(t *testing.T) {
	var s keySplit
	check := func(spec []uint8) bool {
		keys := make([]messages.Key, len(spec))
		for i, b := range spec {
			keys[i] = messages.Key(sched.AppendKey(nil, sched.NamespaceID(1+b%3), messages.Hash(fmt.Sprint(i)), int(b/3%3)))
		}
		var flat []messages.Key
		seen := map[[2]int]bool{}
		nsDone := map[sched.NamespaceID]bool{}
		var last sched.NamespaceID
		for run := range s.runs(keys) {
			id := [2]int{int(run.ns), run.group}
			if seen[id] || len(run.keys) == 0 || (run.ns != last && nsDone[run.ns]) {
				return false
			}
			seen[id], nsDone[last], last = true, true, run.ns
			for _, k := range run.keys {
				if ns, _, g := sched.SplitKey(k); ns != run.ns || g != run.group {
					return false
				}
			}
			flat = append(flat, run.keys...)
		}
		// Each key once, and the keys of one run in their original order.
		if len(flat) != len(keys) {
			return false
		}
		pos := map[messages.Key]int{}
		for i, k := range keys {
			pos[k] = i
		}
		for i := 1; i < len(flat); i++ {
			a, b := flat[i-1], flat[i]
			na, _, ga := sched.SplitKey(a)
			nb, _, gb := sched.SplitKey(b)
			if na == nb && ga == gb && pos[a] > pos[b] {
				return false
			}
		}
		slices.Sort(flat)
		return len(slices.Compact(flat)) == len(keys)
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 500}))
}

// fillKV writes records, each the hash lengths of one event's keys, as one
// engine's messages at a fixed time, and returns the messages.
func fillKV(recs [][]int) [][]byte {
	m := kvMessage{now: func() time.Time { return time.Unix(1764547200, 5e8) }}
	var out [][]byte
	emit := func(_ string, _ uint64, b []byte) { out = append(out, slices.Clone(b)) }
	for i, rec := range recs {
		keys := make([]messages.Key, len(rec))
		for j, n := range rec {
			keys[j] = messages.Key(sched.AppendKey(nil, 1, messages.Hash(bytes.Repeat([]byte{byte(i + j)}, n)), 0))
		}
		m.add("e", 1, messages.KVBlockStored, 0, messages.MediumCPU, "ns", keys, emit)
	}
	m.flush(emit)
	return out
}

// exactFit changes recs' hash lengths until the first message is exactly
// kvMessageBytes: the last key it holds grows by half an even slack; an
// odd slack first takes a 1-byte key (5 bytes) into the first record, or
// pushes the last key out when under 5.
func exactFit(t *testing.T, recs [][]int) [][]byte {
	t.Helper()
	for range 8 {
		out := fillKV(recs)
		require.Greater(t, len(out), 1, "the records must need more than one message")
		slack := kvMessageBytes - len(out[0])
		require.GreaterOrEqual(t, slack, 0)
		if slack == 0 {
			return out
		}
		last := -1 // the first message's keys, less one
		for _, e := range decodeKV(t, out[0]) {
			last += len(e.BlockHashes)
		}
		r, j := 0, last
		for j >= len(recs[r]) {
			j -= len(recs[r])
			r++
		}
		switch {
		case slack%2 == 0:
			recs[r][j] += slack / 2
		case slack >= 5:
			recs[0] = slices.Insert(recs[0], 1, 1)
		default:
			recs[r][j] += (slack + 1) / 2
		}
	}
	t.Fatal("no exact fit found")
	return nil
}

// A key that fits exactly is not cut: a message reaches kvMessageBytes to
// the byte, both where one event's keys are cut across messages and where a
// new event starts one; none passes it, and every hash arrives once, in
// order.
func TestKVMessageCutsExactlyAtTheBound(t *testing.T) {
	for _, tc := range []struct {
		name string
		recs [][]int
	}{
		{"inside one event", [][]int{slices.Repeat([]int{60}, 5000)}},
		{"between events", func() [][]int {
			recs := make([][]int, 4000)
			for i := range recs {
				recs[i] = []int{60}
			}
			return recs
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := exactFit(t, tc.recs)
			require.Len(t, out[0], kvMessageBytes)
			var want, got []int
			for _, rec := range tc.recs {
				want = append(want, rec...)
			}
			for i, body := range out {
				require.LessOrEqual(t, len(body), kvMessageBytes, "message %d", i)
				for _, e := range decodeKV(t, body) {
					for _, h := range e.BlockHashes {
						got = append(got, len(h)/2)
					}
				}
			}
			require.Equal(t, want, got, "every hash once, in order")
		})
	}
}

// With a linger, the changes added while the journal waits go out
// together, in order, in one message; closing does not wait the linger
// out; a short linger publishes on its own.
func TestKVJournalLingerGathersChanges(t *testing.T) {
	var mu sync.Mutex
	var got [][]messages.KVEvent
	emit := func(_ string, _ uint64, body []byte) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, decodeKV(t, body))
	}
	emitted := func() [][]messages.KVEvent {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
	target := func(string, sched.NamespaceID) (string, string, string, uint64) { return "m", ".m", "ea", 1 }
	key := func(h string) messages.Key { return messages.Key(sched.AppendKey(nil, 1, messages.Hash(h), 0)) }

	j := newKVJournal(emit, target)
	j.linger = time.Hour
	j.start()
	j.pool(true, []messages.Key{key("a")}, "ea")
	j.pool(false, []messages.Key{key("b")}, "ea")
	j.pool(true, []messages.Key{key("c")}, "ea")
	require.Never(t, func() bool { return j.pending() < 3 || len(emitted()) > 0 }, 50*time.Millisecond, time.Millisecond,
		"nothing drains while the journal lingers")
	closed := make(chan struct{})
	go func() { j.close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("close waited for the linger")
	}
	msgs := emitted()
	require.Len(t, msgs, 1, "one message for the three changes")
	require.Len(t, msgs[0], 3)
	for i, typ := range []string{messages.KVBlockStored, messages.KVBlockRemoved, messages.KVBlockStored} {
		require.Equal(t, typ, msgs[0][i].Type, "event %d", i)
	}

	mu.Lock()
	got = nil
	mu.Unlock()
	short := newKVJournal(emit, target)
	short.linger = 5 * time.Millisecond
	short.start()
	defer short.close()
	short.pool(true, []messages.Key{key("d")}, "ea")
	require.Eventually(t, func() bool { return len(emitted()) == 1 }, 10*time.Second, time.Millisecond)
	require.Zero(t, short.pending())
}

// Changes to keys of a namespace with no member are deferred, and go out
// on the next engine to join it before anything else of it: at its join
// (the register's join record) or with the first change drained after it.
// Past the bound an AllBlocksCleared of the namespace goes first and only
// the stores since are kept (PROTOCOL.md "kv_events").
func TestKVJournalDefersANamespaceWithNoMemberUntilOneJoins(t *testing.T) {
	type msg struct {
		engine string
		events []messages.KVEvent
	}
	var got []msg
	emit := func(engine string, _ uint64, body []byte) { got = append(got, msg{engine, decodeKV(t, body)}) }
	member := "ea" // namespace 1's ("n"); namespace 2 ("o") always has eo
	target := func(_ string, ns sched.NamespaceID) (string, string, string, uint64) {
		if ns == 2 {
			return "o", ".o", "eo", 2
		}
		return "n", ".n", member, 1
	}
	key := func(ns sched.NamespaceID, h string) messages.Key { return sched.Key(ns, messages.Hash(h), 0) }
	hx := func(s string) string { return fmt.Sprintf("%x", s) }
	ev := func(typ, medium, ns string, hs ...string) messages.KVEvent {
		for i := range hs {
			hs[i] = hx(hs[i])
		}
		return messages.KVEvent{Type: typ, Medium: medium, Namespace: ns, BlockHashes: hs}
	}
	cpu, disk := messages.MediumCPU, messages.MediumDisk
	stored, removed := messages.KVBlockStored, messages.KVBlockRemoved
	var dj, dd int
	steps := func(j *kvJournal, join bool) {
		j.onDefer = func(deferred, dropped int) { dj, dd = dj+deferred, dd+dropped }
		var m kvMessage
		var keys []messages.Key
		rec := func(engine, typ, medium string, ks ...messages.Key) {
			keys = append(keys[:0], ks...)
			j.publish(&kvRecord{engine: engine, typ: typ, medium: medium, lo: 0, hi: len(keys)}, keys, &m)
		}
		rec("ea", stored, cpu, key(1, "a"), key(1, "b"))
		member = "" // ea left
		rec("ex", removed, cpu, key(1, "a"), key(2, "z"))
		rec("ex", stored, disk, key(1, "a"))
		rec("ex", removed, cpu, key(1, "b"))
		rec("ex", stored, cpu, key(1, "c"))
		member = "eb" // eb joined
		if join {
			j.publish(&kvRecord{engine: "eb", typ: kvJoin, ns: 1}, nil, &m)
		}
		rec("eb", stored, cpu, key(1, "d"))
		m.flush(emit)
	}

	steps(newKVJournal(emit, target), false)
	require.Equal(t, []msg{
		{"ea", []messages.KVEvent{ev(stored, cpu, "n", "a", "b")}},
		{"eo", []messages.KVEvent{ev(removed, cpu, "o", "z")}},
		{"eb", []messages.KVEvent{ev(removed, cpu, "n", "a"), ev(stored, disk, "n", "a"),
			ev(removed, cpu, "n", "b"), ev(stored, cpu, "n", "c"), ev(stored, cpu, "n", "d")}},
	}, got, "the deferred changes go out on the member, in order, before its own")
	require.Equal(t, []int{4, 0}, []int{dj, dd})

	got, dj, dd, member = nil, 0, 0, "ea"
	j := newKVJournal(emit, target)
	j.deferred = newKVDeferred(2)
	steps(j, true)
	require.Equal(t, []msg{
		{"ea", []messages.KVEvent{ev(stored, cpu, "n", "a", "b")}},
		{"eo", []messages.KVEvent{ev(removed, cpu, "o", "z")}},
		{"eb", []messages.KVEvent{{Type: messages.KVAllBlocksCleared, Medium: cpu, Namespace: "n"},
			{Type: messages.KVAllBlocksCleared, Medium: messages.MediumDisk, Namespace: "n"},
			ev(stored, cpu, "n", "c"), ev(stored, cpu, "n", "d")}},
	}, got, "past the bound: a clear of the namespace in each medium, then what it stored since")
	require.Equal(t, []int{4, 3}, []int{dj, dd})
}

// A resync record clears every namespace of the boot in both media: on its
// member at once, and for a namespace with none (its deferred changes
// dropped: the re-announcement after the clear supersedes them) on the
// next engine to join it, before anything else of it, followed by what it
// stored since (PROTOCOL.md "kv_events", reconnect).
func TestKVJournalResyncClearsEveryNamespace(t *testing.T) {
	tj := newTwoNamespaceJournal(t)
	j, key, clr := tj.j, kvTestKey, kvClearEvent
	cpu, disk := messages.MediumCPU, messages.MediumDisk
	stored, removed := messages.KVBlockStored, messages.KVBlockRemoved
	var m kvMessage
	rec := func(typ string, ks ...messages.Key) {
		j.publish(&kvRecord{engine: "ex", typ: typ, medium: cpu, lo: 0, hi: len(ks)}, ks, &m)
	}
	rec(stored, key(2, "a"), key(2, "b")) // deferred: o has no member
	j.publish(&kvRecord{typ: kvResync}, nil, &m)
	rec(stored, key(2, "a"))  // the re-announcement of what is held
	rec(removed, key(2, "c")) // after the clear: tells a router nothing
	rec(stored, key(1, "x"))
	tj.member = "eo"
	j.publish(&kvRecord{engine: "eo", typ: kvJoin, ns: 2}, nil, &m)
	m.flush(tj.emit)
	require.Equal(t, []kvSent{
		{"en", []messages.KVEvent{clr(cpu, "n"), clr(disk, "n"),
			{Type: stored, Medium: cpu, Namespace: "n", BlockHashes: []string{fmt.Sprintf("%x", "x")}}}},
		{"eo", []messages.KVEvent{clr(cpu, "o"), clr(disk, "o"),
			{Type: stored, Medium: cpu, Namespace: "o", BlockHashes: []string{fmt.Sprintf("%x", "a")}}}},
	}, tj.got)
	require.False(t, j.deferred.has(2))
	require.Zero(t, j.deferred.held)
}

// A clear record clears one namespace in one medium, on its member, after
// the namespace's changes queued before it (the first engine of a
// namespace in a boot: DISK, then what the disk holds). With no member
// (the engine left before the journal drained it) its next engine is told
// to forget the namespace in both media, followed by what it stored since.
func TestKVJournalClearsOneNamespaceInOneMedium(t *testing.T) {
	tj := newTwoNamespaceJournal(t)
	j, key, clr := tj.j, kvTestKey, kvClearEvent
	hexOf := func(h string) []string { return []string{fmt.Sprintf("%x", h)} }
	cpu, disk := messages.MediumCPU, messages.MediumDisk
	stored := messages.KVBlockStored
	var m kvMessage
	rec := func(medium string, ks ...messages.Key) {
		j.publish(&kvRecord{engine: "ex", typ: stored, medium: medium, lo: 0, hi: len(ks)}, ks, &m)
	}
	rec(cpu, key(1, "x"))
	j.publish(&kvRecord{engine: "en", typ: kvClear, medium: disk, ns: 1}, nil, &m)
	rec(disk, key(1, "y"))
	rec(cpu, key(2, "a")) // deferred: o has no member
	j.publish(&kvRecord{engine: "gone", typ: kvClear, medium: disk, ns: 2}, nil, &m)
	rec(disk, key(2, "b"))
	j.publish(&kvRecord{engine: "en", typ: kvClear, medium: disk, ns: 3}, nil, &m) // no such namespace: nothing
	tj.member = "eo"
	j.publish(&kvRecord{engine: "eo", typ: kvJoin, ns: 2}, nil, &m)
	m.flush(tj.emit)
	require.Equal(t, []kvSent{
		{"en", []messages.KVEvent{{Type: stored, Medium: cpu, Namespace: "n", BlockHashes: hexOf("x")},
			clr(disk, "n"), {Type: stored, Medium: disk, Namespace: "n", BlockHashes: hexOf("y")}}},
		{"eo", []messages.KVEvent{clr(cpu, "o"), clr(disk, "o"),
			{Type: stored, Medium: disk, Namespace: "o", BlockHashes: hexOf("b")}}},
	}, tj.got)
	require.False(t, j.deferred.has(2))
}

// kvSent is one kv_events message a test journal emitted.
type kvSent struct {
	engine string
	events []messages.KVEvent
}

// twoNamespaceJournal is a journal over namespace 1 ("n", geometry 1,
// whose member is always en) and 2 ("o", geometry 2, whose member is
// member: "" for none); there is no 3. got holds what it emitted.
type twoNamespaceJournal struct {
	j      *kvJournal
	member string
	got    []kvSent
	emit   func(engine string, geo uint64, body []byte)
}

func newTwoNamespaceJournal(t *testing.T) *twoNamespaceJournal {
	tj := &twoNamespaceJournal{}
	tj.emit = func(engine string, _ uint64, body []byte) {
		tj.got = append(tj.got, kvSent{engine, decodeKV(t, body)})
	}
	tj.j = newKVJournal(tj.emit, func(_ string, ns sched.NamespaceID) (string, string, string, uint64) {
		switch ns {
		case 1:
			return "n", ".n", "en", 1
		case 2:
			return "o", ".o", tj.member, 2
		}
		return "", "", "", 0
	})
	tj.j.held = func() []sched.NamespaceID { return []sched.NamespaceID{1, 2} }
	return tj
}

func kvTestKey(ns sched.NamespaceID, h string) messages.Key {
	return sched.Key(ns, messages.Hash(h), 0)
}

func kvClearEvent(medium, ns string) messages.KVEvent {
	return messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: medium, Namespace: ns}
}
