package ingest

import (
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// protocolBatch uses every event type of PROTOCOL.md "EventBatch", with the
// fields its table lists.
const protocolBatch = `{"epoch": "b3f1", "seq": 17, "events": [
  {"type": "added", "request": "r1", "prompt_tokens": 20},
  {"type": "added", "request": "r2", "prompt_tokens": 8, "max_offload_tokens": 4},
  {"type": "hashes", "request": "r1", "start": 0, "hashes": ["00ff", "a1b2"]},
  {"type": "blocks", "request": "r1", "group": 1, "start": 3, "ids": [7, 0, 4294967295]},
  {"type": "tokens", "request": "r1", "computed": 12, "total": 21},
  {"type": "preempted", "request": "r1"},
  {"type": "resumed", "request": "r1"},
  {"type": "finished", "request": "r2", "aborted": true, "computed": 3, "total": 8}
]}`

func TestDecodeBatchProtocolExample(t *testing.T) {
	b, bad, err := DecodeBatch("e1", []byte(protocolBatch), Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	require.Equal(t, messages.EventBatch{Engine: "e1", Epoch: "b3f1", Seq: 17, Events: []messages.Event{
		{Type: messages.EvAdded, Request: "r1", PromptTokens: 20, MaxOffloadTokens: -1},
		{Type: messages.EvAdded, Request: "r2", PromptTokens: 8, MaxOffloadTokens: 4},
		{Type: messages.EvHashes, Request: "r1", Hashes: []messages.Hash{"\x00\xff", "\xa1\xb2"}},
		{Type: messages.EvBlocks, Request: "r1", Group: 1, Start: 3, IDs: []messages.BlockID{7, 0, 4294967295}},
		{Type: messages.EvTokens, Request: "r1", Computed: 12, Total: 21},
		{Type: messages.EvPreempted, Request: "r1"},
		{Type: messages.EvResumed, Request: "r1"},
		{Type: messages.EvFinished, Request: "r2", Aborted: true, Computed: 3, Total: 8},
	}}, b)
}

// TestDecodeBatchRejectsBatch: envelope problems and syntax errors anywhere
// reject the whole batch with ErrMalformed.
func TestDecodeBatchRejectsBatch(t *testing.T) {
	ev := `{"type":"preempted","request":"r1"}`
	for _, tc := range []struct{ name, body string }{
		{"empty body", ``},
		{"not an object", `[]`},
		{"null body", `null`},
		{"truncated", `{"epoch":"e","seq":1,"events":[` + ev},
		{"trailing data", `{"epoch":"e","seq":1,"events":[]} {}`},
		{"trailing comma", `{"epoch":"e","seq":1,"events":[],}`},
		{"single quotes", `{'epoch':"e","seq":1,"events":[]}`},
		{"syntax error in a later event", `{"epoch":"e","seq":1,"events":[` + ev + `,{"type":"tokens","computed":1x}]}`},
		{"syntax error after the events", `{"events":[` + ev + `],"epoch":"e","seq":1,"x":tru}`},
		{"control character in a string", "{\"epoch\":\"e\x01\",\"seq\":1,\"events\":[]}"},
		{"bad escape", `{"epoch":"\q","seq":1,"events":[]}`},
		{"bad unicode escape", `{"epoch":"\u12g4","seq":1,"events":[]}`},
		{"leading zero", `{"epoch":"e","seq":01,"events":[]}`},
		{"bare minus", `{"epoch":"e","seq":-,"events":[]}`},
		{"nesting too deep in an unknown field", `{"epoch":"e","seq":1,"events":[],"x":` + strings.Repeat("[", 10002) + strings.Repeat("]", 10002) + `}`},
		{"missing epoch", `{"seq":1,"events":[]}`},
		{"null epoch", `{"epoch":null,"seq":1,"events":[]}`},
		{"empty epoch", `{"epoch":"","seq":1,"events":[]}`},
		{"epoch over 256 bytes", `{"epoch":"` + strings.Repeat("e", 257) + `","seq":1,"events":[]}`},
		{"epoch not a string", `{"epoch":7,"seq":1,"events":[]}`},
		{"epoch not UTF-8", "{\"epoch\":\"\xff\",\"seq\":1,\"events\":[]}"},
		{"epoch lone surrogate", `{"epoch":"\ud800","seq":1,"events":[]}`},
		{"missing seq", `{"epoch":"e","events":[]}`},
		{"negative seq", `{"epoch":"e","seq":-1,"events":[]}`},
		{"negative zero seq (a uint64 to encoding/json)", `{"epoch":"e","seq":-0,"events":[]}`},
		{"fractional seq", `{"epoch":"e","seq":1.5,"events":[]}`},
		{"exponent seq", `{"epoch":"e","seq":1e3,"events":[]}`},
		{"string seq", `{"epoch":"e","seq":"1","events":[]}`},
		{"seq over int64", `{"epoch":"e","seq":9223372036854775808,"events":[]}`},
		{"missing events", `{"epoch":"e","seq":1}`},
		{"null events", `{"epoch":"e","seq":1,"events":null}`},
		{"events not an array", `{"epoch":"e","seq":1,"events":{}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := DecodeBatch("e1", []byte(tc.body), Limits{})
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}

func TestDecodeBatchRejectsTooManyEvents(t *testing.T) {
	ev := `{"type":"resumed","request":"r"}`
	body := `{"epoch":"e","seq":1,"events":[` + ev + `,` + ev + `,` + ev + `]}`
	_, _, err := DecodeBatch("e1", []byte(body), Limits{MaxEvents: 2})
	require.ErrorIs(t, err, ErrMalformed)
	require.ErrorIs(t, err, ErrTooLarge)
	_, _, err = DecodeBatch("e1", []byte(body), Limits{MaxEvents: 3})
	require.NoError(t, err)
}

// A body's '{'s guess its events' count, but braces that are no accepted
// event (in a string, a skipped field, a run of junk) made DecodeBatch
// reserve an Event (120 bytes) per byte: 60 KB of them reserved 7 MB. The
// reservation is bounded by the events the body can hold.
func TestDecodeBatchReservesByLengthNotBraces(t *testing.T) { // not parallel: it reads the process's allocation count
	braces := strings.Repeat("{", 60_000)
	for name, body := range map[string]string{
		"in a string":        `{"x":"` + braces + `","epoch":"e","seq":0,"events":[]}`,
		"in a skipped field": `{"x":[` + strings.Repeat("{},", 20_000) + `{}],"epoch":"e","seq":0,"events":[]}`,
		"as rejected events": `{"epoch":"e","seq":0,"events":[{"type":"resumed","request":"r"}` + braces,
	} {
		b, _, _ := DecodeBatch("e1", []byte(body), Limits{})
		require.LessOrEqual(t, cap(b.Events), len(body)/len(`{"type":"added","request":"r"}`), name)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for range 4 {
			_, _, _ = DecodeBatch("e1", []byte(body), Limits{})
		}
		runtime.ReadMemStats(&after)
		per := float64(after.TotalAlloc-before.TotalAlloc) / 4 / float64(len(body))
		require.Less(t, per, 8.0, "%s: %.1f bytes allocated per byte of body", name, per)
	}
}

func TestDecodeBatchAcceptsEdgeCases(t *testing.T) {
	for _, tc := range []struct {
		name, event string
		want        messages.Event
	}{
		{"unknown fields are ignored", `{"x":{"y":[1,{"z":null}]},"type":"resumed","request":"r","future":"v2"}`,
			messages.Event{Type: messages.EvResumed, Request: "r"}},
		{"type may come last", `{"request":"r","computed":3,"total":4,"type":"tokens"}`,
			messages.Event{Type: messages.EvTokens, Request: "r", Computed: 3, Total: 4}},
		{"absent counts are zero (omitempty encoders)", `{"type":"blocks","request":"r","ids":[1]}`,
			messages.Event{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1}}},
		{"null is absent", `{"type":"added","request":"r","prompt_tokens":null,"max_offload_tokens":null}`,
			messages.Event{Type: messages.EvAdded, Request: "r", MaxOffloadTokens: -1}},
		{"max_offload_tokens 0 is set", `{"type":"added","request":"r","prompt_tokens":5,"max_offload_tokens":0}`,
			messages.Event{Type: messages.EvAdded, Request: "r", PromptTokens: 5}},
		{"the last of duplicate keys wins", `{"type":"tokens","request":"a","request":"b","computed":1,"computed":2}`,
			messages.Event{Type: messages.EvTokens, Request: "b", Computed: 2}},
		{"request ids may hold subject characters", `{"type":"resumed","request":"a.*.>"}`,
			messages.Event{Type: messages.EvResumed, Request: "a.*.>"}},
		{"escapes in a request id are decoded", `{"type":"resumed","request":"q\"\\\/\n\u00e9\ud83d\ude00"}`,
			messages.Event{Type: messages.EvResumed, Request: "q\"\\/\né😀"}},
		{"escapes in a key are decoded", `{"\u0074ype":"resumed","request":"r"}`,
			messages.Event{Type: messages.EvResumed, Request: "r"}},
		{"a 256-byte request id", `{"type":"resumed","request":"` + strings.Repeat("r", 256) + `"}`,
			messages.Event{Type: messages.EvResumed, Request: strings.Repeat("r", 256)}},
		{"the largest group", `{"type":"blocks","request":"r","group":63,"ids":[]}`,
			messages.Event{Type: messages.EvBlocks, Request: "r", Group: 63}},
		{"a 64-byte hash", `{"type":"hashes","request":"r","hashes":["` + strings.Repeat("ab", 64) + `"]}`,
			messages.Event{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{messages.Hash(strings.Repeat("\xab", 64))}}},
		{"fields the type does not use are dropped", `{"type":"preempted","request":"r","ids":[1],"hashes":["aa"],"computed":4}`,
			messages.Event{Type: messages.EvPreempted, Request: "r"}},
		{"negative zero is zero", `{"type":"tokens","request":"r","computed":-0,"total":0}`,
			messages.Event{Type: messages.EvTokens, Request: "r"}},
		{"white space everywhere", " {\n\t\"type\" : \"resumed\" ,\r\n \"request\" : \"r\" } ",
			messages.Event{Type: messages.EvResumed, Request: "r"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, bad, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":0,"events":[`+tc.event+`]}`), Limits{})
			require.NoError(t, err)
			require.Empty(t, bad)
			require.Equal(t, []messages.Event{tc.want}, b.Events)
		})
	}
}

func TestDecodeBatchLastEventsKeyWins(t *testing.T) {
	b, bad, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":1,"events":[{"type":"x"}],
		"events":[{"type":"resumed","request":"r"}]}`), Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	require.Len(t, b.Events, 1)
}

// TestDecodeBatchEventsOwnTheirSlices: the decoder reuses scratch space, so
// check that no two events (or later appends) share backing arrays.
func TestDecodeBatchEventsOwnTheirSlices(t *testing.T) {
	b, _, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":1,"events":[
		{"type":"blocks","request":"r","ids":[1,2]},
		{"type":"blocks","request":"r","ids":[3,4]},
		{"type":"hashes","request":"r","hashes":["01"]},
		{"type":"hashes","request":"r","hashes":["02"]}]}`), Limits{})
	require.NoError(t, err)
	grown := append(b.Events[0].IDs, 9)
	grown[0] = 100
	require.Equal(t, []messages.BlockID{1, 2}, b.Events[0].IDs)
	require.Equal(t, []messages.BlockID{3, 4}, b.Events[1].IDs)
	require.Equal(t, []messages.Hash{"\x01"}, b.Events[2].Hashes)
	require.Equal(t, []messages.Hash{"\x02"}, b.Events[3].Hashes)
}

// TestDecodeBatchNestingLimitMatchesEncodingJSON: both readers allow 10000
// nested objects and arrays and no more, so they agree on what is valid.
func TestDecodeBatchNestingLimitMatchesEncodingJSON(t *testing.T) {
	for _, tc := range []struct {
		where string
		wrap  func(v string) string
		outer int // containers around the value
	}{
		{"envelope", func(v string) string { return `{"epoch":"e","seq":1,"events":[],"x":` + v + `}` }, 1},
		{"event", func(v string) string { return `{"epoch":"e","seq":1,"events":[` + v + `]}` }, 2},
		{"field", func(v string) string { return `{"epoch":"e","seq":1,"events":[{"x":` + v + `}]}` }, 3},
		{"hash", func(v string) string { return `{"epoch":"e","seq":1,"events":[{"hashes":[` + v + `]}]}` }, 4},
		{"id", func(v string) string { return `{"epoch":"e","seq":1,"events":[{"ids":[` + v + `]}]}` }, 4},
	} {
		for _, extra := range []int{0, 1} {
			n := maxDepth - tc.outer + extra
			body := []byte(tc.wrap(strings.Repeat("[", n) + strings.Repeat("]", n)))
			_, _, err := DecodeBatch("e1", body, Limits{})
			require.Equal(t, json.Valid(body), err == nil, "%s, %d deep: %v", tc.where, tc.outer+n, err)
			require.Equal(t, extra == 0, err == nil, "%s, %d deep: %v", tc.where, tc.outer+n, err)
		}
	}
}

// The decoder's working memory is pooled across batches; what a batch
// returns is its own: decoding many more batches, some concurrently,
// changes nothing in events kept from an earlier one.
func TestDecodedEventsOutliveTheDecodersScratch(t *testing.T) {
	first, bad, err := DecodeBatch("e1", []byte(protocolBatch), Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	want, err := json.Marshal(first)
	require.NoError(t, err)
	other := strings.NewReplacer(`"00ff", "a1b2"`, `"1111", "2222", "3333"`, `[7, 0, 4294967295]`, `[9, 9, 9, 9]`,
		`"r1"`, `"q1"`).Replace(protocolBatch)
	done := make(chan error, 4)
	for range 4 {
		go func() {
			for range 200 {
				if _, _, err := DecodeBatch("e2", []byte(other), Limits{}); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	for range 4 {
		require.NoError(t, <-done)
	}
	got, err := json.Marshal(first)
	require.NoError(t, err)
	require.JSONEq(t, string(want), string(got))
}

// A request id seen in an earlier batch (its events span several) is not
// allocated again: the decoder's scratch keeps recent ids. Every id still
// comes back with its own bytes, whatever else shares its cache slot.
func TestInternReusesAnIDAcrossBatches(t *testing.T) {
	var cache [internSlots]string
	d := &decoder{interned: &cache}
	a := intern(d.internSlot([]byte("req-1")), []byte("req-1"))
	// (the next batch: nothing else carries over)
	b := intern(d.internSlot([]byte("req-1")), []byte("req-1"))
	require.Equal(t, unsafe.StringData(a), unsafe.StringData(b), "one allocation for both batches")
	raw := []byte("req-1")
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = intern(d.internSlot(raw), raw) }))
	for i := range 4 * internSlots {
		id := fmt.Sprintf("r%d", i)
		require.Equal(t, id, intern(d.internSlot([]byte(id)), []byte(id)))
	}
}

// The cache holds an engine's requests in flight across a prefill: of 1,024
// ids met in one round of batches, most are still there for the next round
// (with 256 slots, about 2% were; with 4,096, about 78%).
func TestInternKeepsAThousandRequestsInFlight(t *testing.T) {
	var cache [internSlots]string
	d := &decoder{interned: &cache}
	ids := make([][]byte, 1024)
	first := make([]string, len(ids))
	for i := range ids {
		ids[i] = fmt.Appendf(nil, "cmpl-%08d-0", i)
		first[i] = intern(d.internSlot(ids[i]), ids[i])
	}
	kept := 0
	for i, id := range ids {
		if unsafe.StringData(intern(d.internSlot(id), id)) == unsafe.StringData(first[i]) {
			kept++
		}
	}
	require.GreaterOrEqual(t, kept, 600, "ids of the last round still interned")
}

// DecodeBatch itself uses the cache: decoding one body again gives the same
// id strings, not new ones. The scratch comes from a sync.Pool, which may
// drop it (a collection, the race detector's random drops), so only most
// repeats are expected to share; one sharing pair proves the wiring (up to
// 500 tries: under -race, the pool drops a quarter of what it is given).
func TestDecodeBatchReusesIDsOfEarlierBatches(t *testing.T) {
	// Through one scratch, as a pooled one is reused: sync.Pool itself
	// promises no reuse (under -race it drops a quarter of what it is given).
	sc := new(scratch)
	first, _, err := decodeWith(sc, "e1", []byte(protocolBatch), Limits{}, nil)
	require.NoError(t, err)
	second, _, err := decodeWith(sc, "e1", []byte(protocolBatch), Limits{}, nil)
	require.NoError(t, err)
	require.Equal(t, first.Events[0].Request, second.Events[0].Request)
	require.Same(t, unsafe.StringData(first.Events[0].Request), unsafe.StringData(second.Events[0].Request),
		"the second batch allocated its id afresh")
}

// A batch's events share arenas for their hash and block id slices: each
// slice is capped, so a consumer appending to one event's copies instead of
// writing over the next event's.
func TestEventSlicesShareNoTail(t *testing.T) {
	body := `{"epoch": "e", "seq": 1, "events": [
  {"type": "hashes", "request": "r1", "start": 0, "hashes": ["00ff"]},
  {"type": "hashes", "request": "r2", "start": 0, "hashes": ["a1b2", "c3d4"]},
  {"type": "blocks", "request": "r1", "group": 0, "start": 0, "ids": [1]},
  {"type": "blocks", "request": "r2", "group": 0, "start": 0, "ids": [2, 3]}
]}`
	b, bad, err := DecodeBatch("e1", []byte(body), Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	ev := b.Events
	require.Len(t, ev, 4)
	h1, h2 := ev[0].Hashes, ev[1].Hashes
	require.Equal(t, len(h1), cap(h1), "hashes capped")
	require.Equal(t, len(ev[2].IDs), cap(ev[2].IDs), "ids capped")
	_ = append(h1, "zz")
	_ = append(ev[2].IDs, 99)
	require.Equal(t, []messages.Hash{messages.Hash("\xa1\xb2"), messages.Hash("\xc3\xd4")}, h2)
	require.Equal(t, []messages.BlockID{2, 3}, ev[3].IDs)
}

// An id met before skips its UTF-8 check, but only for bytes that came
// without a lone surrogate: "\ud800" unescapes to the bytes of U+FFFD, the
// same as a valid id sent before it, and is still refused. Invalid UTF-8
// is refused after a valid id in the same cache too.
func TestAKnownIDIsNoPassForAnInvalidOne(t *testing.T) {
	var l lexer
	out, valid := l.unescape([]byte(`\ud800`))
	require.False(t, valid)
	require.Equal(t, "\uFFFD", string(out), "the premise: the same bytes as the valid id")
	body := `{"epoch":"e","seq":1,"events":[` +
		`{"type":"resumed","request":"\uFFFD"},{"type":"resumed","request":"\ud800"},` +
		"{\"type\":\"resumed\",\"request\":\"a\xffb\"},{\"type\":\"resumed\",\"request\":\"a\xffb\"}]}"
	b, bad, err := DecodeBatch("e", []byte(body), Limits{})
	require.NoError(t, err)
	require.Len(t, b.Events, 1)
	require.Equal(t, "\uFFFD", b.Events[0].Request)
	require.Len(t, bad, 3)
	for _, e := range bad {
		require.ErrorIs(t, e.Err, ErrBadRequestID)
	}
}
