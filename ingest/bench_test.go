package ingest

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// benchBatch builds a realistic 32-event batch, as one engine step would
// publish it: 4 new requests, and for 8 running requests their new 32-byte
// (sha256) block hashes, the block ids of two groups and a tokens event.
func benchBatch(tb testing.TB) []byte {
	r := rand.New(rand.NewPCG(7, 7))
	hash := func() string {
		b := make([]byte, 32)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return hexOf(string(b))
	}
	var events []any
	for i := range 4 {
		events = append(events, map[string]any{"type": "added", "request": fmt.Sprintf("cmpl-%08x-0", 100+i), "prompt_tokens": 900 + i})
	}
	for i := range 8 {
		req := fmt.Sprintf("cmpl-%08x-0", i)
		events = append(events, map[string]any{"type": "hashes", "request": req, "start": 60 + i,
			"hashes": []string{hash(), hash(), hash()}})
		for g := range 2 {
			events = append(events, map[string]any{"type": "blocks", "request": req, "group": g, "start": 60 + i,
				"ids": []uint32{r.Uint32N(1 << 16), r.Uint32N(1 << 16), r.Uint32N(1 << 16)}})
		}
		events = append(events, map[string]any{"type": "tokens", "request": req, "computed": 1000 + 16*i, "total": 1001 + 16*i})
	}
	if len(events) != 36 {
		tb.Fatalf("%d events", len(events))
	}
	events = events[:32]
	b, err := json.Marshal(map[string]any{"epoch": "8d0b6a1e-4c1f-4d7e-9a55-0f7c2b3e1a90", "seq": 12345, "events": events})
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

func BenchmarkDecodeBatch(b *testing.B) {
	body := benchBatch(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	events := 0
	for b.Loop() {
		batch, bad, err := DecodeBatch("e1", body, Limits{})
		if err != nil || len(bad) != 0 || len(batch.Events) != 32 {
			b.Fatalf("%v %v %d", err, bad, len(batch.Events))
		}
		events += len(batch.Events)
	}
	sec := b.Elapsed().Seconds()
	b.ReportMetric(float64(events)/sec, "events/s")
	b.ReportMetric(sec*1e9/float64(events), "ns/event")
}

// BenchmarkDecodeBatchEncodingJSON is the baseline DecodeBatch replaces:
// encoding/json into a wire struct per event (decoding only; no checks).
func BenchmarkDecodeBatchEncodingJSON(b *testing.B) {
	body := benchBatch(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	events := 0
	for b.Loop() {
		var env struct {
			Epoch  string            `json:"epoch"`
			Seq    uint64            `json:"seq"`
			Events []json.RawMessage `json:"events"`
		}
		if err := json.Unmarshal(body, &env); err != nil {
			b.Fatal(err)
		}
		for _, raw := range env.Events {
			var w wireEventJSON
			if err := json.Unmarshal(raw, &w); err != nil {
				b.Fatal(err)
			}
		}
		events += len(env.Events)
	}
	sec := b.Elapsed().Seconds()
	b.ReportMetric(float64(events)/sec, "events/s")
	b.ReportMetric(sec*1e9/float64(events), "ns/event")
}

// junkBody is a batch of n rejected events of two bytes each (`1,`): the
// cheapest body that makes the decoder report an event error per element.
func junkBody(n int) []byte {
	return []byte(`{"epoch":"e","seq":1,"events":[1` + strings.Repeat(`,1`, n-1) + `]}`)
}

// BenchmarkDecodeBatchJunk decodes a batch of Limits.MaxEvents (65,536)
// junk events: what a hostile engine's 131 KB body costs the decoder.
func BenchmarkDecodeBatchJunk(b *testing.B) {
	const n = 1 << 16
	body := junkBody(n)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		batch, _, err := DecodeBatch("e1", body, Limits{})
		if err != nil || len(batch.Events) != 0 {
			b.Fatalf("%v %d", err, len(batch.Events))
		}
	}
}
