package ingest

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// fuzzLimits are small, so the fuzzer reaches the limit checks.
var fuzzLimits = Limits{MaxIDs: 8, MaxGroups: 4, MaxHashBytes: 4, MaxEvents: 16, MaxRequestIDBytes: 16}

// FuzzDecodeBatch checks that DecodeBatch never panics, agrees with
// encoding/json on what is valid JSON, reserves no more events than the
// body could hold, and accepts only events that satisfy the invariants the
// actors rely on. Its seeds run under plain go test.
func FuzzDecodeBatch(f *testing.F) {
	f.Add([]byte(protocolBatch))
	f.Add([]byte(`{"epoch":"e","seq":0,"events":[]}`))
	f.Add([]byte(`{"epoch":"e","seq":1,"events":[{"type":"blocks","request":"r","group":3,"start":2,"ids":[0,1,4294967295]},5,null,{"type":"x"}]}`))
	f.Add([]byte(`{"epoch":"\u00e9","seq":2,"events":[{"type":"hashes","request":"\ud83d\ude00","hashes":["0a0b0c0d","ff"],"start":9}],"x":[{}]}`))
	f.Add([]byte(`{"epoch":"e","seq":3,"events":[{"type":"added","request":"r","prompt_tokens":4,"max_offload_tokens":0},{"type":"finished","request":"r","aborted":false,"computed":1,"total":2}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, bad, err := DecodeBatch("e1", data, fuzzLimits)
		if !json.Valid(data) {
			require.Error(t, err, "invalid JSON accepted")
		}
		if err != nil {
			require.ErrorIs(t, err, ErrMalformed)
			require.Empty(t, b.Events)
			require.Empty(t, bad)
			return
		}
		require.Equal(t, "e1", b.Engine)
		require.NotEmpty(t, b.Epoch)
		require.LessOrEqual(t, len(b.Epoch), MaxEpochBytes)
		require.True(t, utf8.ValidString(b.Epoch))
		rejected := 0
		for _, e := range bad {
			rejected += e.Count
		}
		require.LessOrEqual(t, len(b.Events)+rejected, fuzzLimits.MaxEvents)
		require.LessOrEqual(t, cap(b.Events), len(data)/minEventBytes, "reserved more events than the body holds")
		for i, ev := range b.Events {
			checkEventInvariants(t, ev)
			// Re-encoding an accepted event and decoding it again gives it back.
			again, again2, err := DecodeBatch("e1", []byte(`{"epoch":"e","seq":0,"events":[`+encodeEvent(t, ev)+`]}`), fuzzLimits)
			require.NoError(t, err)
			require.Empty(t, again2)
			require.Equal(t, []messages.Event{ev}, again.Events, "event %d", i)
		}
		last := -1
		for _, e := range bad {
			require.Greater(t, e.Index, last, "EventErrors in order, once each")
			last = e.Index
			require.ErrorIs(t, e.Err, ErrBadEvent)
			require.NotEqual(t, "other", messages.RejectLabel(e.Err))
		}
	})
}

func checkEventInvariants(t *testing.T, ev messages.Event) {
	t.Helper()
	require.NotZero(t, ev.Type)
	require.NotEqual(t, "", ev.Type.String())
	require.NotEmpty(t, ev.Request)
	require.LessOrEqual(t, len(ev.Request), fuzzLimits.MaxRequestIDBytes)
	require.True(t, utf8.ValidString(ev.Request))
	require.GreaterOrEqual(t, ev.Start, 0)
	require.GreaterOrEqual(t, ev.Group, 0)
	require.Less(t, ev.Group, fuzzLimits.MaxGroups)
	require.GreaterOrEqual(t, ev.PromptTokens, 0)
	require.GreaterOrEqual(t, ev.Computed, 0)
	require.GreaterOrEqual(t, ev.Total, 0)
	require.LessOrEqual(t, len(ev.Hashes), fuzzLimits.MaxIDs)
	require.LessOrEqual(t, len(ev.IDs), fuzzLimits.MaxIDs)
	for _, h := range ev.Hashes {
		require.NotEmpty(t, h)
		require.LessOrEqual(t, len(h), fuzzLimits.MaxHashBytes)
	}
	if ev.Type == messages.EvAdded {
		require.GreaterOrEqual(t, ev.MaxOffloadTokens, -1)
	}
}

// wireEventJSON is the wire form of one event, with every field, for tests
// that encode events with encoding/json.
type wireEventJSON struct {
	Type             string   `json:"type"`
	Request          string   `json:"request"`
	Aborted          bool     `json:"aborted,omitempty"`
	Group            int      `json:"group,omitempty"`
	Start            int      `json:"start,omitempty"`
	PromptTokens     int      `json:"prompt_tokens,omitempty"`
	MaxOffloadTokens *int     `json:"max_offload_tokens,omitempty"`
	Computed         int      `json:"computed,omitempty"`
	Total            int      `json:"total,omitempty"`
	Hashes           []string `json:"hashes,omitempty"`
	IDs              []uint32 `json:"ids,omitempty"`
}

func encodeEvent(t testing.TB, ev messages.Event) string {
	w := wireEventJSON{Type: ev.Type.String(), Request: ev.Request, Aborted: ev.Aborted, Group: ev.Group,
		Start: ev.Start, PromptTokens: ev.PromptTokens, Computed: ev.Computed, Total: ev.Total}
	if ev.Type == messages.EvAdded && ev.MaxOffloadTokens >= 0 {
		w.MaxOffloadTokens = &ev.MaxOffloadTokens
	}
	for _, h := range ev.Hashes {
		w.Hashes = append(w.Hashes, hexOf(string(h)))
	}
	for _, id := range ev.IDs {
		w.IDs = append(w.IDs, uint32(id))
	}
	b, err := json.Marshal(w)
	require.NoError(t, err)
	return string(b)
}

func hexOf(s string) string {
	const digits = "0123456789abcdef"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		b.WriteByte(digits[s[i]>>4])
		b.WriteByte(digits[s[i]&0xf])
	}
	return b.String()
}

// FuzzDecodeSpec checks that DecodeSpec never panics and that an accepted
// spec satisfies what the register handler relies on.
func FuzzDecodeSpec(f *testing.F) {
	f.Add([]byte(protocolSpec))
	f.Add([]byte(`{"tokens_per_hash":16,"blocks_per_chunk":1,"num_gpu_blocks":8,"segments":[{"cuda_ipc":"` +
		strings.Repeat("ab", 64) + `","bytes":4096}],"groups":[{"kind":"eagle","tokens_per_block":16,"regions":[{"segment":0,"offset":0,"block_stride":512,"block_bytes":512}]}]}`))
	f.Add([]byte(`{"tokens_per_hash":0}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := DecodeSpec(data, Limits{})
		if err != nil {
			require.ErrorIs(t, err, ErrBadSpec)
			return
		}
		require.GreaterOrEqual(t, s.TokensPerHash, 1)
		require.GreaterOrEqual(t, s.BlocksPerChunk, 1)
		require.GreaterOrEqual(t, s.NumGPUBlocks, 1)
		require.NotEmpty(t, s.Groups)
		require.NotEmpty(t, s.Segments)
		for _, seg := range s.Segments {
			require.True(t, (seg.Shm == "") != (seg.CUDAIPC == ""), "exactly one segment kind")
			require.NotContains(t, seg.Shm, "/")
		}
		for _, g := range s.Groups {
			require.GreaterOrEqual(t, g.TokensPerBlock, 1)
			require.Zero(t, g.TokensPerBlock*s.BlocksPerChunk%s.TokensPerHash)
			require.NotEmpty(t, g.Regions)
			for _, r := range g.Regions {
				require.True(t, r.Segment >= 0 && r.Segment < len(s.Segments))
				require.GreaterOrEqual(t, r.BlockBytes, int64(1))
				require.GreaterOrEqual(t, r.BlockStride, r.BlockBytes)
				require.GreaterOrEqual(t, r.Offset, int64(0))
			}
		}
	})
}

// FuzzDecodeLoad checks the encoding/json decoders of the request bodies
// (load, lookup, heartbeat): they never panic and fail only with
// ErrMalformed; what they accept is within the limits and what the node
// relies on, and decodes the same once encoded again; an accepted
// heartbeat's epoch and seq are ones a batch can carry (it begins no epoch
// that no batch could continue, and claims no seq no batch could have).
func FuzzDecodeLoad(f *testing.F) {
	f.Add([]byte(`{"request":"r2","hashes":["aa","bb"],"num_tokens":24,"blocks":[[5,6,7],[0,0,9]]}`))
	f.Add([]byte(`{"hashes":["00ff"]}`))
	f.Add([]byte(`{"epoch":"e\u00e9","seq":3}`))
	f.Add([]byte(`{"epoch":"\ud800","seq":1,"request":"\udfff"}`))
	f.Add([]byte(`{"epoch":"e","seq":18446744073709551615}`)) // past a batch's seq
	f.Fuzz(func(t *testing.T, data []byte) {
		if l, err := DecodeLoad(data, fuzzLimits); err != nil {
			require.ErrorIs(t, err, ErrMalformed, "DecodeLoad")
		} else {
			require.NoError(t, CheckRequestID(l.Request, fuzzLimits))
			require.GreaterOrEqual(t, l.NumTokens, 0)
			require.LessOrEqual(t, len(l.Blocks), fuzzLimits.MaxGroups)
			checkHashes(t, l.Hashes)
			req := messages.LoadRequest{Request: l.Request, NumTokens: l.NumTokens, Hashes: hexAll(l.Hashes)}
			for _, ids := range l.Blocks {
				require.LessOrEqual(t, len(ids), fuzzLimits.MaxIDs)
				w := make([]int64, len(ids))
				for i, id := range ids {
					w[i] = int64(id)
				}
				req.Blocks = append(req.Blocks, w)
			}
			again, err := DecodeLoad(mustJSON(t, req), fuzzLimits)
			require.NoError(t, err)
			require.Equal(t, l, again)
		}
		if hs, err := DecodeLookup(data, fuzzLimits); err != nil {
			require.ErrorIs(t, err, ErrMalformed, "DecodeLookup")
		} else {
			checkHashes(t, hs)
			again, err := DecodeLookup(mustJSON(t, messages.LookupRequest{Hashes: hexAll(hs)}), fuzzLimits)
			require.NoError(t, err)
			require.Equal(t, hs, again)
		}
		if hb, err := DecodeHeartbeat(data); err != nil {
			require.ErrorIs(t, err, ErrMalformed, "DecodeHeartbeat")
		} else {
			b, _, err := DecodeBatch("e1", []byte(`{"epoch":`+string(mustJSON(t, hb.Epoch))+`,"seq":`+
				strconv.FormatUint(hb.Seq, 10)+`,"events":[]}`), fuzzLimits)
			require.NoError(t, err, "a heartbeat's epoch %q or seq %d no batch can carry", hb.Epoch, hb.Seq)
			require.Equal(t, hb.Epoch, b.Epoch)
			require.Equal(t, hb.Seq, b.Seq)
		}
	})
}

func checkHashes(t *testing.T, hs []messages.Hash) {
	t.Helper()
	require.LessOrEqual(t, len(hs), fuzzLimits.MaxIDs)
	for _, h := range hs {
		require.NotEmpty(t, h)
		require.LessOrEqual(t, len(h), fuzzLimits.MaxHashBytes)
	}
}

func hexAll(hs []messages.Hash) []string {
	var out []string
	for _, h := range hs {
		out = append(out, hexOf(string(h)))
	}
	return out
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}
