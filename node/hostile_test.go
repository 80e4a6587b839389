package node_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// The hostile suite (issue 11) replays each attack of the issue against a
// real node and checks that it is refused or contained: the victim's bytes
// unchanged, its lookups unaffected, the node still serving. The NATS
// permission attacks are in hostile_nats_test.go.

// victim registers engine "vic", stores the 4-chunk prefix hs from blocks
// 40..43 and returns it with a copy of those blocks' bytes.
func victim(t *testing.T, e *env) (*testEngine, []string, [][]byte) {
	t.Helper()
	vic := e.newEngine("vic", defaultOpts())
	vic.register()
	hs := []string{hash("v", 0), hash("v", 1), hash("v", 2), hash("v", 3)}
	var want [][]byte
	for i := range 4 {
		vic.fill(0, messages.BlockID(40+i), 77)
		want = append(want, bytes.Clone(vic.block(0, messages.BlockID(40+i))))
	}
	vic.send(added("r", 16), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 40, 41, 42, 43), tokensEv("r", 16, 16))
	recv(t, vic.stored, "victim's store")
	require.Equal(t, 16, vic.lookup(hs))
	return vic, hs, want
}

// intact checks the victim: its blocks hold what it wrote, its lookup hits
// the whole prefix, and a load brings its own bytes back.
func intact(t *testing.T, vic *testEngine, hs []string, want [][]byte) {
	t.Helper()
	for i := range 4 {
		require.Equal(t, want[i], vic.block(0, messages.BlockID(40+i)), "victim block %d unchanged", 40+i)
	}
	require.Equal(t, 16, vic.lookup(hs), "victim's lookup unaffected")
	r := vic.loadInto("check", hs, 16, []int{50, 51, 52, 53})
	require.True(t, r.OK, r.Error)
	for i := range 4 {
		require.Equal(t, want[i], vic.block(0, messages.BlockID(50+i)), "victim loads its own bytes")
	}
}

// Attack: register with another engine's segment name, to read its blocks
// (store them, load them into one's own segment) or write them (load into
// them). Refused at register, before anything is opened.
func TestHostileOtherEnginesSegment(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested)
	vic, hs, want := victim(t, e)
	mal := e.newEngine("mal", defaultOpts())
	before := rejected(t, e, "bad_spec")
	for _, name := range []string{"vic-seg", "vic.seg", "vic", "mal"} {
		spec := mal.spec
		spec.Segments = []messages.Segment{{Shm: name}}
		var reply messages.RegisterReply
		require.NoError(t, jsonUnmarshal(mal.request("register", spec), &reply))
		require.False(t, reply.OK, "segment %q", name)
		require.Contains(t, reply.Error, `is not engine "mal"'s`)
	}
	require.Equal(t, before+4, rejected(t, e, "bad_spec"), "each refusal counted")
	var r messages.LookupReply
	require.NoError(t, jsonUnmarshal(mal.request("lookup", map[string]any{"hashes": hs}), &r))
	require.Contains(t, r.Error, "unknown engine", "the attacker is not registered")
	intact(t, vic, hs, want)
	mal.register() // its own segment is fine
}

// Attack: a hard link in the shm directory to a file outside it, or to the
// victim's object; a symlink. Refused (one link, no symlink), and the file
// outside is never written.
func TestHostileLinksInShmDir(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested)
	vic, hs, want := victim(t, e)
	outside := filepath.Join(t.TempDir(), "secret")
	secret := bytes.Repeat([]byte("secret!"), 64<<10)
	require.NoError(t, os.WriteFile(outside, secret, 0o600))
	require.NoError(t, os.Link(outside, filepath.Join(e.dir, "mal-out")))
	require.NoError(t, os.Link(filepath.Join(e.dir, "vic-seg"), filepath.Join(e.dir, "mal-vic")))
	require.NoError(t, os.Symlink(outside, filepath.Join(e.dir, "mal-sym")))
	mal := e.newEngine("mal", defaultOpts())
	for name, want := range map[string]string{"mal-out": "has 2 links", "mal-vic": "has 2 links", "mal-sym": "symlink"} {
		spec := mal.spec
		spec.Segments = []messages.Segment{{Shm: name}}
		var reply messages.RegisterReply
		require.NoError(t, jsonUnmarshal(mal.request("register", spec), &reply))
		require.False(t, reply.OK, name)
		require.Contains(t, reply.Error, want, name)
	}
	require.NoError(t, os.Remove(filepath.Join(e.dir, "mal-vic"))) // the victim's object has one link again
	got, err := os.ReadFile(outside)
	require.NoError(t, err)
	require.Equal(t, secret, got, "the file outside was not touched")
	intact(t, vic, hs, want)
}

// Attack: evict the victim's keys through the shared pool, store one's own
// bytes under the victim's hashes, and wait for the victim to load them
// (poisoning). Namespaces make the attacker's keys other keys: the victim's
// next lookup misses and its load fails; it never receives the attacker's
// bytes. The eviction itself is announced in the victim's namespace.
func TestHostilePoisonAfterEviction(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested, func(c *node.Config) { c.PoolBytes = 8 * 256 }) // 8 chunk slots
	vic, hs, _ := victim(t, e)
	mal := e.newEngine("mal", defaultOpts())
	mal.register()
	var own []string
	for i := range 8 {
		own = append(own, hash("m", i))
		mal.fill(0, messages.BlockID(i+1), 13)
	}
	mal.send(added("flood", 32), hashesEv("flood", 0, own...), blocksEv("flood", 0, 0, 1, 2, 3, 4, 5, 6, 7, 8),
		tokensEv("flood", 32, 32))
	recv(t, mal.stored, "attacker's flood")
	// The eviction is announced in the victim's namespace, on the victim's
	// kv_events: routers see it, the attacker does not learn its hashes.
	removed := map[string]bool{}
	deadline := time.After(5 * time.Second)
	for len(removed) < 4 {
		select {
		case b := <-vic.kv:
			for _, ev := range b.Events {
				if ev.Type == messages.KVBlockRemoved {
					require.Equal(t, "vic", ev.Namespace, "an eviction names the key's namespace, not the evicter's")
					for _, h := range ev.BlockHashes {
						removed[h] = true
					}
				}
			}
		case <-deadline:
			t.Fatalf("BlockRemoved for the victim's keys not seen; got %v", removed)
		}
	}
	for _, h := range hs {
		require.True(t, removed[h], "victim's key %s removed", h)
	}
	checkOwn := func(b messages.KVEventBatch) {
		for _, ev := range b.Events {
			require.Equal(t, "mal", ev.Namespace, "the attacker's kv_events carry only its own namespace")
			for _, h := range ev.BlockHashes {
				require.NotContains(t, hs, h, "the attacker never sees the victim's hashes")
			}
		}
	}
	// The flood's BlockStored go out at the end of the completion step that
	// published its stored, so they may trail it: wait for them, then let
	// the status reply (which follows everything published before it) mark
	// the end of the rest.
	checkOwn(recv(t, mal.kv, "the attacker's own BlockStored"))
	mal.sync()
	for drained := false; !drained; {
		select {
		case b := <-mal.kv:
			checkOwn(b)
		default:
			drained = true
		}
	}
	// The poison: the attacker's bytes under the victim's hashes.
	for i := range 4 {
		mal.fill(0, messages.BlockID(20+i), 99)
	}
	mal.send(added("poison", 16), hashesEv("poison", 0, hs...), blocksEv("poison", 0, 0, 20, 21, 22, 23),
		tokensEv("poison", 16, 16))
	st := recv(t, mal.stored, "attacker's poison stored")
	require.Len(t, st.Chunks, 4)
	require.Equal(t, hs[0]+"00000000", st.Chunks[0].Key, "stored keys are hash+group on the wire, no namespace")
	require.Equal(t, 16, mal.lookup(hs), "the attacker sees its own keys")

	require.Equal(t, 0, vic.lookup(hs), "the victim does not see the attacker's keys")
	for i := range 4 {
		vic.fill(0, messages.BlockID(50+i), 5)
	}
	before := bytes.Clone(vic.seg.Bytes())
	r := vic.loadInto("victim-load", hs, 16, []int{50, 51, 52, 53})
	require.False(t, r.OK, "the victim's load must not find the attacker's chunks")
	require.True(t, bytes.Equal(before, vic.seg.Bytes()), "not one byte of the victim's memory written")
}

// Attack: a squatter registers first with tiny blocks. Its geometry binds
// only its own namespace; an engine that shares a namespace must match what
// the namespace holds (refused bad_spec otherwise), and the namespace keeps
// that geometry for the boot, even after its engines change spec.
func TestHostileSquatterGeometry(t *testing.T) {
	t.Parallel()
	// H4's pool v2 removes the fixed slot size; until then the first engine
	// would cut the slots, so the test sets them.
	e := startNode(t, silenceNotTested, func(c *node.Config) { c.SlotBytes = 256 })
	tiny := defaultOpts()
	tiny.blockBytes = 16
	sq := e.newEngine("sq", tiny)
	sq.spec.Namespace = "llama"
	sq.register()
	vic, hs, want := victim(t, e) // its own namespace: unaffected by the squatter
	intact(t, vic, hs, want)

	real1 := e.newEngine("real1", defaultOpts())
	real1.spec.Namespace = "llama"
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(real1.request("register", real1.spec), &reply))
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, `namespace "llama"`)
	require.Contains(t, reply.Error, "block_bytes 256, the namespace holds 16")

	real1.spec.Namespace = "llama-70b-fp8" // a namespace the squatter does not hold
	real1.register()
	real2 := e.newEngine("real2", tiny)
	real2.spec.Namespace = "llama-70b-fp8"
	require.NoError(t, jsonUnmarshal(real2.request("register", real2.spec), &reply))
	require.False(t, reply.OK, "a later squatter cannot change a namespace's geometry either")
	intact(t, vic, hs, want)
}

// Attack: 75M block ids in 25 messages, to make the node hold gigabytes.
// max_model_len bounds what a request holds; every event past it is
// rejected too_large and counted, the request keeps nothing of it. The
// default run sends 25 messages of 3 events × 20k ids (1.5M ids, fast under -race);
// KVACTORS_HOSTILE_FULL=1 sends the 75M (3 × 1M per message).
func TestHostileHugeBlockLists(t *testing.T) { // not parallel: it measures the process's heap
	e := startNode(t, silenceNotTested)
	vic, hs, want := victim(t, e)
	mal := e.newEngine("mal", defaultOpts()) // 64 blocks × 4 tokens: max_model_len 256
	mal.register()
	mal.send(added("big", 16))
	per := 20_000
	if os.Getenv("KVACTORS_HOSTILE_FULL") == "1" {
		per = 1 << 20
	}
	ids := make([]int, per)
	for i := range ids {
		ids[i] = 1 + i%9 // one digit: 3M ids fit in one 8 MiB message
	}
	before := rejected(t, e, "too_large")
	var mem runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&mem)
	heapBefore := mem.HeapInuse
	for range 25 {
		mal.send(blocksEv("big", 0, 0, ids...), blocksEv("big", 0, 0, ids...), blocksEv("big", 0, 0, ids...))
	}
	huge := make([]string, 300)
	for i := range huge {
		huge[i] = hash("h", i)
	}
	mal.send(hashesEv("big", 0, huge...))
	st := mal.sync()
	require.Len(t, st.Requests, 1)
	require.Zero(t, st.Requests[0].Groups[0].Blocks, "the request holds none of the ids")
	require.Equal(t, before+76, rejected(t, e, "too_large"), "every oversized event rejected and counted")
	runtime.GC()
	runtime.ReadMemStats(&mem)
	t.Logf("%d ids sent; heap in use %d MiB before, %d MiB after", 75*per, heapBefore>>20, mem.HeapInuse>>20)
	require.Less(t, int64(mem.HeapInuse)-int64(heapBefore), int64(64<<20), "nothing of the flood is retained")
	mal.send(blocksEv("big", 0, 0, 1, 2, 3, 4), tokensEv("big", 16, 16))
	st = mal.sync()
	require.Equal(t, 4, st.Requests[0].Groups[0].Blocks, "within bounds the request still works")
	intact(t, vic, hs, want)
}

// Attack: many engines × many segments, to exhaust the process's map count
// for everyone; many requests in one engine. Each bound refuses past it with
// a clear error, counted; the engines already in keep working. (Scaled: the
// issue's 1,100 engines × 64 segments meet the defaults, 256 engines and
// 4096 segments, the same way.)
func TestHostileEngineSegmentAndRequestLimits(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested, func(c *node.Config) {
		c.MaxEngines, c.MaxMappedSegments, c.MaxRequests = 6, 12, 3
	})
	vic, hs, want := victim(t, e) // 1 segment
	segs := func(te *testEngine, n int) {
		te.spec.Segments = nil
		te.spec.Groups = append([]messages.GroupSpec(nil), te.spec.Groups...)
		regions := te.spec.Groups[0].Regions
		for i := range n {
			name := te.id + "-seg"
			if i > 0 {
				name = te.id + "-extra" + string(rune('a'+i))
				seg, err := shm.Create(e.dir, name, 64*16)
				require.NoError(t, err)
				t.Cleanup(func() { _ = seg.Remove() })
				// Every segment is used by a region: one no region uses is refused.
				regions = append(regions, messages.Region{Segment: i, BlockStride: 16, BlockBytes: 16})
			}
			te.spec.Segments = append(te.spec.Segments, messages.Segment{Shm: name})
		}
		te.spec.Groups[0].Regions = regions
	}
	before := rejected(t, e, "limit")
	var refused []string
	var ms []*testEngine
	for i := range 5 {
		te := e.newEngine("m"+string(rune('0'+i)), defaultOpts())
		ms = append(ms, te)
		segs(te, 4)
		var reply messages.RegisterReply
		require.NoError(t, jsonUnmarshal(te.request("register", te.spec), &reply))
		if !reply.OK {
			refused = append(refused, reply.Error)
		}
	}
	// 1 + 4 + 4 = 9 segments; the third attacker would make 13 > 12.
	require.Len(t, refused, 3)
	require.Contains(t, refused[0], "--max-mapped-segments")
	for i := 5; i < 9; i++ {
		te := e.newEngine("n"+string(rune('0'+i)), defaultOpts())
		var reply messages.RegisterReply
		require.NoError(t, jsonUnmarshal(te.request("register", te.spec), &reply))
		if !reply.OK {
			refused = append(refused, reply.Error)
		}
	}
	// Engines: vic, m0, m1 + n5, n6, n7 = 6; n8 is one too many.
	require.Len(t, refused, 4)
	require.Contains(t, refused[3], "--max-engines")
	require.Equal(t, before+4, rejected(t, e, "limit"), "each refusal counted")

	// Requests per engine: the fourth added is refused, counted as "limit".
	lim := rejected(t, e, "limit")
	vic.send(added("q1", 8), added("q2", 8), added("q3", 8))
	st := vic.sync()
	require.Len(t, st.Requests, 3, "r, q1, q2: the third bound is reached")
	require.Equal(t, lim+1, rejected(t, e, "limit"))
	vic.send(finishedEv("q1", false, 0, 8))
	recv(t, vic.released, "q1 released")
	vic.send(added("q4", 8))
	require.Len(t, vic.sync().Requests, 3, "a finished request frees its place")

	require.Equal(t, 12.0, metricValue(t, e.reg, "kvactors_isolation_segments_mapped", nil), "at the bound")
	// An unregistered engine gives its segments and its place back.
	var un messages.UnregisterReply
	require.NoError(t, jsonUnmarshal(ms[0].request("unregister", map[string]any{}), &un))
	require.True(t, un.OK, un.Error)
	late := e.newEngine("late", defaultOpts())
	segs(late, 4)
	late.register()
	intact(t, vic, hs, want)
}

// Attack: an anonymous client creates a JetStream stream in the node's temp
// dir and fills it. The embedded server runs without JetStream.
func TestHostileAnonymousJetStream(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested)
	js, err := e.nc.JetStream(nats.MaxWait(2 * time.Second))
	require.NoError(t, err)
	_, err = js.AddStream(&nats.StreamConfig{Name: "fill", Subjects: []string{"fill.>"}})
	require.Error(t, err, "no JetStream to create a stream in")
	require.True(t, errors.Is(err, nats.ErrJetStreamNotEnabled) || errors.Is(err, nats.ErrNoResponders), "got %v", err)
}

// Attack: a flood of rejected input, to fill the disk with log lines. Every
// rejection is counted; only the first few per reason are logged.
func TestHostileRejectionFloodLogsBounded(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	e := startNode(t, silenceNotTested, func(c *node.Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	vic, hs, want := victim(t, e)
	mal := e.newEngine("mal", defaultOpts())
	mal.register()
	before := rejected(t, e, "malformed")
	const flood = 2000
	for range flood {
		require.NoError(t, e.nc.Publish("kvactors.mal.events", []byte(`{"epoch":`)))
	}
	require.NoError(t, e.nc.Flush())
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if got := rejected(t, e, "malformed"); got != before+flood {
			return fmt.Errorf("%v of %d malformed batches counted", got-before, flood)
		}
		return nil
	})
	require.Equal(t, 5, strings.Count(logs.String(), "reason=malformed"), "the log holds the first few only")
	intact(t, vic, hs, want)
}

// Attack: ids that are prefixes of each other. Engine "e1" may name
// "e1-kv-seg" by the name rule, which is the segment of engine "e1-kv". A
// name mapped by one live engine is refused to every other, whichever came
// first.
func TestHostilePrefixIDsShareNoSegment(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested)
	vic := e.newEngine("e1-kv", defaultOpts()) // its segment: "e1-kv-seg"
	vic.register()
	mal := e.newEngine("e1", defaultOpts())
	spec := mal.spec
	spec.Segments = []messages.Segment{{Shm: "e1-kv-seg"}}
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(mal.request("register", spec), &reply))
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, `shm "e1-kv-seg" is mapped by engine "e1-kv"`)
	mal.register() // its own "e1-seg" is fine
	vic.register() // and the victim's identical re-register is still a no-op
}

// Attack: whoever may rename in the shm directory (one uid for every
// engine, or a directory without the sticky bit) renames the victim's live
// object to a name of its own and registers it: the name is its own, the
// object has one link and is no symlink, and no live engine maps that name,
// yet the node would map the victim's memory a second time, for the
// attacker to store (read) and load into (write). Refused: two live engines
// never map one object, whatever names it has now.
func TestHostileRenamedVictimObjectIsNotMapped(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested)
	vic, hs, want := victim(t, e)
	stolen := filepath.Join(e.dir, "mal-stolen")
	require.NoError(t, os.Rename(filepath.Join(e.dir, "vic-seg"), stolen))
	mal := e.newEngine("mal", defaultOpts())
	spec := mal.spec
	spec.Segments = []messages.Segment{{Shm: "mal-stolen"}}
	before := rejected(t, e, "bad_spec")
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(mal.request("register", spec), &reply))
	require.False(t, reply.OK, "the victim's object under the attacker's name")
	require.Contains(t, reply.Error, `is mapped by engine "vic"`)
	require.Equal(t, before+1, rejected(t, e, "bad_spec"), "the refusal counted")
	require.NoError(t, os.Rename(stolen, filepath.Join(e.dir, "vic-seg")))
	intact(t, vic, hs, want)
	mal.register() // its own segment is fine
	vic.register() // and the victim's identical re-register is still a no-op
}

// The 1,100 engines × 64 segments against the default bounds (256
// engines, 4096 mapped segments): the node maps 4096 segments at most, the
// process's map count stays far from vm.max_map_count, and the victim keeps
// working. Creates 4096 small shm objects, so it runs only with
// KVACTORS_HOSTILE_FULL=1 (TestHostileEngineSegmentAndRequestLimits is the
// scaled version that always runs).
func TestHostileManyEnginesAtDefaults(t *testing.T) {
	if os.Getenv("KVACTORS_HOSTILE_FULL") != "1" {
		t.Skip("set KVACTORS_HOSTILE_FULL=1 to replay 1,100 engines × 64 segments")
	}
	e := startNode(t, silenceNotTested)
	vic, hs, want := victim(t, e)
	maps := func() int {
		b, err := os.ReadFile("/proc/self/maps")
		require.NoError(t, err)
		return bytes.Count(b, []byte("\n"))
	}
	mapsBefore := maps()
	accepted, limited := 0, 0
	for i := range 1100 {
		id := fmt.Sprintf("a%04d", i)
		spec := vic.spec
		spec.Segments = nil
		var regions []messages.Region // every segment used, or the register is refused
		for s := range 64 {
			name := fmt.Sprintf("%s.%02d", id, s)
			if i < node.DefaultConfig().MaxMappedSegments/64 { // only these get as far as opening
				seg, err := shm.Create(e.dir, name, 64*256)
				require.NoError(t, err)
				require.NoError(t, seg.Close()) // the engine side's mapping is not the point
				t.Cleanup(func() { _ = seg.Remove() })
			}
			spec.Segments = append(spec.Segments, messages.Segment{Shm: name})
			regions = append(regions, messages.Region{Segment: s, BlockStride: 256, BlockBytes: 256})
		}
		spec.Groups = append([]messages.GroupSpec(nil), vic.spec.Groups...)
		spec.Groups[0].Regions = regions
		body, err := json.Marshal(spec)
		require.NoError(t, err)
		m, err := testkit.EngineRequest(e.nc, id, "kvactors."+id+".register", body, 5*time.Second)
		require.NoError(t, err)
		var reply messages.RegisterReply
		require.NoError(t, json.Unmarshal(m.Data, &reply))
		switch {
		case reply.OK:
			accepted++
		case strings.Contains(reply.Error, "--max-mapped-segments") || strings.Contains(reply.Error, "--max-engines"):
			limited++
		default:
			t.Fatalf("engine %s: unexpected refusal %q", id, reply.Error)
		}
	}
	t.Logf("1100 engines × 64 segments: %d accepted, %d refused at a bound; process maps %d → %d",
		accepted, limited, mapsBefore, maps())
	require.Equal(t, (node.DefaultConfig().MaxMappedSegments-1)/64, accepted, "the victim holds one segment")
	require.Less(t, maps()-mapsBefore, node.DefaultConfig().MaxMappedSegments+256)
	intact(t, vic, hs, want)
}

// Attack: re-register over and over with a fresh namespace each time, to
// grow the node's namespace table. One engine id opens at most 16
// (TestOneEngineCannotUseUpTheNodesNamespaces); the namespaces of an id
// that left go with it once the table needs room, so the table stays
// within 16 × --max-engines and never stays full for good.
func TestHostileNamespaceChurnIsBounded(t *testing.T) {
	t.Parallel()
	e := startNode(t, silenceNotTested, func(c *node.Config) { c.MaxEngines = 1 })
	// One engine id opens at most 16 (TestOneEngineCannotUseUpTheNodesNamespaces):
	// two ids, one after the other, reach the node's 16.
	first := e.newEngine("first", defaultOpts())
	for i := range 10 {
		first.spec.Namespace = fmt.Sprintf("ns-%d", i)
		first.register()
	}
	var un messages.UnregisterReply
	require.NoError(t, jsonUnmarshal(first.request("unregister", map[string]any{}), &un))
	require.True(t, un.OK)
	mal := e.newEngine("mal", defaultOpts())
	before := rejected(t, e, "limit")
	for i := 10; i < 26; i++ { // past the node's 16: first's forgotten to make room
		mal.spec.Namespace = fmt.Sprintf("ns-%d", i)
		mal.register()
	}
	mal.spec.Namespace = "ns-26"
	var reply messages.RegisterReply
	require.NoError(t, jsonUnmarshal(mal.request("register", mal.spec), &reply))
	require.False(t, reply.OK)
	require.Contains(t, reply.Error, `engine "mal" opened 16 namespaces since the node last forgot its id`)
	require.Equal(t, before+1, rejected(t, e, "limit"))
	require.Equal(t, 16.0, metricValue(t, e.reg, "kvactors_isolation_namespaces", nil))
	mal.spec.Namespace = "ns-13" // an open namespace is still fine
	mal.register()
}
