package ingest

import (
	"bytes"
	"encoding/json"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"testing/quick"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/wire"
)

// nodeStored is a stored body as the node writes it (wire's pieces).
func nodeStored(request string, job uint64, bytes int64, chunks ...messages.StoredChunk) []byte {
	b := wire.AppendStoredOpen(nil, request, job)
	for i, c := range chunks {
		if i > 0 {
			b = append(b, ',')
		}
		b = wire.AppendStoredChunkHex(b, c.Group, c.Index, c.Key)
	}
	return wire.AppendStoredClose(b, bytes)
}

func TestDecodeStoredReadsTheNodesBodies(t *testing.T) {
	body := nodeStored("r\"1\u00e9", 7, 512, messages.StoredChunk{Group: 0, Index: 3, Key: "\x01\xab"},
		messages.StoredChunk{Group: 1, Index: 3, Key: "\xff"})
	st, err := DecodeStored(body)
	require.NoError(t, err)
	require.Equal(t, messages.Stored{Request: "r\"1\u00e9", Job: 7, Bytes: 512, Chunks: []messages.StoredChunk{
		{Group: 0, Index: 3, Key: "01ab"}, {Group: 1, Index: 3, Key: "ff"}}}, st)

	var want messages.Stored
	require.NoError(t, json.Unmarshal(body, &want))
	require.Equal(t, want, st, "the same value as encoding/json")

	st, err = DecodeStored(nodeStored("r", 1, 0))
	require.NoError(t, err)
	require.Equal(t, messages.Stored{Request: "r", Job: 1, Chunks: []messages.StoredChunk{}}, st, "no chunks: empty, as encoding/json")
}

func TestDecodeStoredEdgeCases(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       messages.Stored
	}{
		{"absent and null are zero", `{"request":null,"job":null,"chunks":null}`, messages.Stored{}},
		{"unknown fields skipped", `{"x":[{"y":[1,{}]}],"request":"r","chunks":[{"z":true,"index":2}],"v":2}`,
			messages.Stored{Request: "r", Chunks: []messages.StoredChunk{{Index: 2}}}},
		// encoding/json would merge the repeated list into the first: {Group:1, Index:5}.
		{"last repeated key wins whole", `{"job":1,"job":2,"chunks":[{"group":1},{"group":2}],"chunks":[{"index":5}]}`,
			messages.Stored{Job: 2, Chunks: []messages.StoredChunk{{Index: 5}}}},
		{"white space and escapes", " {\n\"request\" : \"a\\u0062\\n\" , \"bytes\" : -0 } ",
			messages.Stored{Request: "ab\n"}},
		{"the largest job", `{"job":9223372036854775807}`, messages.Stored{Job: math.MaxInt64}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := DecodeStored([]byte(tc.body))
			require.NoError(t, err)
			require.Equal(t, tc.want, st)
		})
	}
}

func TestDecodeStoredRejects(t *testing.T) {
	for _, body := range []string{
		``, `[]`, `null`, `{`, `{"request":"r"} x`, `{"request":"r",}`,
		`{"request":1}`, `{"request":"\ud800"}`, "{\"request\":\"\xff\"}",
		`{"job":-1}`, `{"job":-0}`, `{"job":1.5}`, `{"job":"1"}`, `{"job":9223372036854775808}`, `{"bytes":1e3}`,
		`{"chunks":{}}`, `{"chunks":[null]}`, `{"chunks":[1]}`, `{"chunks":[{"group":"0"}]}`,
		`{"chunks":[{"index":true}]}`, `{"chunks":[{"key":5}]}`, `{"chunks":[{"key":"a"}`,
	} {
		_, err := DecodeStored([]byte(body))
		require.ErrorIs(t, err, ErrMalformed, "%q", body)
	}
}

// TestDecodeStoredRoundTrips: any Stored value, encoded by encoding/json,
// decodes to itself.
func TestDecodeStoredRoundTrips(t *testing.T) {
	f := func(request string, job uint64, bytes int64, groups, indexes []int, keys []string) bool {
		st := messages.Stored{Request: request, Job: job & math.MaxInt64, Bytes: bytes, Chunks: []messages.StoredChunk{}}
		for i := range min(len(groups), len(indexes), len(keys)) {
			st.Chunks = append(st.Chunks, messages.StoredChunk{Group: groups[i], Index: indexes[i], Key: keys[i]})
		}
		body, err := json.Marshal(st)
		if err != nil {
			return false
		}
		var want messages.Stored
		if json.Unmarshal(body, &want) != nil { // invalid UTF-8 comes back replaced
			return false
		}
		got, err := DecodeStored(body)
		if err != nil {
			t.Logf("%s: %v", body, err)
			return false
		}
		if !reflect.DeepEqual(want, got) {
			t.Logf("%s: want %+v, got %+v", body, want, got)
			return false
		}
		return true
	}
	require.NoError(t, quick.Check(f, &quick.Config{MaxCount: 2000}))
}

// FuzzDecodeStored checks DecodeStored against referenceStored (encoding/json
// plus the documented rules) on any input: the same verdict, the same value.
func FuzzDecodeStored(f *testing.F) {
	f.Add(nodeStored("r1", 3, 256, messages.StoredChunk{Index: 1, Key: "\x00\x01"}))
	f.Add([]byte(`{"request":"\u00e9\ud83d\ude00","x":{"y":[null,true]},"chunks":[{"group":-1,"index":2,"key":""}],"bytes":-5}`))
	f.Add([]byte(`{"chunks":[{"group":1}],"chunks":null,"job":0,"Chunks":10}`))
	// A bad value is refused even when a repeated key follows with a good
	// one (encoding/json refuses it too); the reference once kept the last.
	f.Add([]byte(`{"job":-1,"job":1}`))
	f.Add([]byte(`{"request":5,"request":"a","chunks":[{"group":"x","group":1}]}`))
	f.Add([]byte(`{"chunks":[{"group":1,"group":null}],"bytes":1,"bytes":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := DecodeStored(data)
		if err != nil {
			require.ErrorIs(t, err, ErrMalformed)
		}
		if !utf8.Valid(data) || bytes.Contains(bytes.ToLower(data), []byte(`\ud`)) {
			return // encoding/json replaces what DecodeStored rejects: no reference
		}
		want, ok := referenceStored(data)
		require.Equal(t, ok, err == nil, "verdict: %v", err)
		if ok {
			require.Equal(t, want, st)
		}
	})
}

// referenceStored is DecodeStored's contract written over encoding/json's
// generic values (numbers: json.Number), the members of each object in
// order (exact keys), so that a bad value is refused even when a repeated
// key follows it, as encoding/json refuses it, and the last good one wins.
func referenceStored(data []byte) (st messages.Stored, ok bool) {
	if !json.Valid(data) {
		return st, false
	}
	obj, isObj := referenceMembers(data)
	if !isObj {
		return st, false
	}
	text := func(x any) (string, bool) {
		s, isStr := x.(string)
		return s, isStr || x == nil
	}
	integer := func(x any, lo, hi int64) (int64, bool) {
		if x == nil {
			return 0, true
		}
		n, isNum := x.(json.Number)
		i, err := strconv.ParseInt(string(n), 10, 64)
		return i, isNum && err == nil && lo <= i && i <= hi
	}
	for _, m := range obj {
		var good bool
		switch m.key {
		case "request":
			st.Request, good = text(m.val)
		case "job":
			var j int64
			j, good = integer(m.val, 0, math.MaxInt64)
			n, _ := m.val.(json.Number)
			good = good && !strings.HasPrefix(string(n), "-") // unsigned: no sign, not even -0
			st.Job = uint64(j)
		case "bytes":
			st.Bytes, good = integer(m.val, math.MinInt64, math.MaxInt64)
		case "chunks":
			st.Chunks, good = referenceChunks(m.raw, integer, text)
		default:
			good = true
		}
		if !good {
			return messages.Stored{}, false
		}
	}
	return st, true
}

// referenceMember is one member of a JSON object: its key, its value as
// sent and as a generic value.
type referenceMember struct {
	key string
	raw json.RawMessage
	val any
}

// referenceMembers is the members of the JSON object data in order, or
// false if data is not an object.
func referenceMembers(data []byte) ([]referenceMember, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, false
	}
	var out []referenceMember
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, false
		}
		var m referenceMember
		m.key, _ = tok.(string)
		if dec.Decode(&m.raw) != nil {
			return nil, false
		}
		vd := json.NewDecoder(bytes.NewReader(m.raw))
		vd.UseNumber()
		if vd.Decode(&m.val) != nil {
			return nil, false
		}
		out = append(out, m)
	}
	return out, true
}

func referenceChunks(raw json.RawMessage, integer func(any, int64, int64) (int64, bool), text func(any) (string, bool)) ([]messages.StoredChunk, bool) {
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil {
		return nil, false
	}
	if list == nil {
		return nil, true // null
	}
	out := []messages.StoredChunk{}
	for _, e := range list {
		obj, isObj := referenceMembers(e)
		if !isObj {
			return nil, false
		}
		var ch messages.StoredChunk
		for _, m := range obj {
			var good bool
			var n int64
			switch m.key {
			case "group":
				n, good = integer(m.val, math.MinInt, math.MaxInt)
				ch.Group = int(n)
			case "index":
				n, good = integer(m.val, math.MinInt, math.MaxInt)
				ch.Index = int(n)
			case "key":
				ch.Key, good = text(m.val)
			default:
				good = true
			}
			if !good {
				return nil, false
			}
		}
		out = append(out, ch)
	}
	return out, true
}

func BenchmarkDecodeStored(b *testing.B) {
	var chunks []messages.StoredChunk
	for i := range 6 {
		chunks = append(chunks, messages.StoredChunk{Group: i % 2, Index: i / 2, Key: "0123456789abcdef0123456789abcdef\x00\x00\x00\x01"})
	}
	body := nodeStored("bench-x-e0-r123456", 42, 1536, chunks...)
	b.Run("DecodeStored", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := DecodeStored(body); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var st messages.Stored
			if err := json.Unmarshal(body, &st); err != nil {
				b.Fatal(err)
			}
		}
	})
}
