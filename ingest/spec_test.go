package ingest

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// protocolSpec is the EngineSpec example of PROTOCOL.md, verbatim.
const protocolSpec = `{
  "tokens_per_hash": 4,
  "blocks_per_chunk": 3,
  "num_gpu_blocks": 1024,
  "offload_prompt_only": false,
  "segments": [{"shm": "kvactors-e1"}],
  "groups": [
    {"kind": "full", "tokens_per_block": 4,
     "regions": [{"segment": 0, "offset": 0, "block_stride": 4096, "block_bytes": 4096}]},
    {"kind": "sliding_window", "tokens_per_block": 4, "sliding_window": 8,
     "regions": [{"segment": 0, "offset": 4194304, "block_stride": 4096, "block_bytes": 4096}]}
  ]
}`

func TestDecodeSpecProtocolExample(t *testing.T) {
	s, err := DecodeSpec([]byte(protocolSpec), Limits{})
	require.NoError(t, err)
	require.Equal(t, messages.EngineSpec{
		TokensPerHash: 4, BlocksPerChunk: 3, NumGPUBlocks: 1024,
		Segments: []messages.Segment{{Shm: "kvactors-e1"}},
		Groups: []messages.GroupSpec{
			{Kind: messages.KindFull, TokensPerBlock: 4,
				Regions: []messages.Region{{Segment: 0, Offset: 0, BlockStride: 4096, BlockBytes: 4096}}},
			{Kind: messages.KindSlidingWindow, TokensPerBlock: 4, SlidingWindow: 8,
				Regions: []messages.Region{{Segment: 0, Offset: 4194304, BlockStride: 4096, BlockBytes: 4096}}},
		},
	}, s)
}

func TestDecodeSpecAcceptsCUDAIPCAndEagle(t *testing.T) {
	s, err := DecodeSpec([]byte(`{"tokens_per_hash":16,"blocks_per_chunk":1,"num_gpu_blocks":2147483648,
		"segments":[{"cuda_ipc":"`+strings.Repeat("0f", 64)+`","device":1,"bytes":1048576}],
		"groups":[{"kind":"eagle","tokens_per_block":16,"regions":[{"segment":0,"offset":0,"block_stride":64,"block_bytes":32}]}],
		"future_field":true}`), Limits{})
	require.NoError(t, err)
	require.Equal(t, messages.Segment{CUDAIPC: strings.Repeat("0f", 64), Device: 1, Bytes: 1 << 20}, s.Segments[0])
}

// specWith returns the protocol example after edit changed its decoded form.
func specWith(t *testing.T, edit func(s map[string]any)) []byte {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(protocolSpec), &m))
	edit(m)
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return b
}

func group(m map[string]any, i int) map[string]any {
	return m["groups"].([]any)[i].(map[string]any)
}

func region(m map[string]any, g, i int) map[string]any {
	return group(m, g)["regions"].([]any)[i].(map[string]any)
}

func segment(m map[string]any, i int) map[string]any {
	return m["segments"].([]any)[i].(map[string]any)
}

func TestDecodeSpecRejects(t *testing.T) {
	manyGroups := make([]any, 65)
	for i := range manyGroups {
		manyGroups[i] = map[string]any{"kind": "full", "tokens_per_block": 4,
			"regions": []any{map[string]any{"segment": 0, "block_stride": 1, "block_bytes": 1}}}
	}
	manyRegions := make([]any, 4097)
	for i := range manyRegions {
		manyRegions[i] = map[string]any{"segment": 0, "block_stride": 1, "block_bytes": 1}
	}
	for _, tc := range []struct {
		name string
		edit func(m map[string]any)
		want string // part of the message
	}{
		{"tokens_per_hash 0", func(m map[string]any) { m["tokens_per_hash"] = 0 }, "tokens_per_hash"},
		{"tokens_per_hash missing", func(m map[string]any) { delete(m, "tokens_per_hash") }, "tokens_per_hash"},
		{"blocks_per_chunk 0", func(m map[string]any) { m["blocks_per_chunk"] = 0 }, "blocks_per_chunk"},
		{"num_gpu_blocks 0", func(m map[string]any) { m["num_gpu_blocks"] = 0 }, "num_gpu_blocks"},
		{"num_gpu_blocks over uint32 ids", func(m map[string]any) { m["num_gpu_blocks"] = int64(1)<<32 + 1 }, "num_gpu_blocks"},
		{"num_gpu_blocks over 2^31", func(m map[string]any) { m["num_gpu_blocks"] = int64(1)<<31 + 1 }, "num_gpu_blocks"},
		{"no groups", func(m map[string]any) { m["groups"] = []any{} }, "groups"},
		{"over 64 groups", func(m map[string]any) { m["groups"] = manyGroups }, "groups"},
		{"unknown kind", func(m map[string]any) { group(m, 0)["kind"] = "mamba" }, "kind"},
		{"missing kind", func(m map[string]any) { delete(group(m, 0), "kind") }, "kind"},
		{"tokens_per_block 0", func(m map[string]any) { group(m, 0)["tokens_per_block"] = 0 }, "tokens_per_block"},
		{"chunk not a multiple of tokens_per_hash", func(m map[string]any) { group(m, 1)["tokens_per_block"] = 3 }, "multiple of tokens_per_hash"},
		{"sliding window 0", func(m map[string]any) { group(m, 1)["sliding_window"] = 0 }, "sliding_window"},
		{"no regions", func(m map[string]any) { group(m, 0)["regions"] = []any{} }, "regions"},
		{"over 4096 regions", func(m map[string]any) { group(m, 0)["regions"] = manyRegions }, "regions"},
		{"segment index out of range", func(m map[string]any) { region(m, 0, 0)["segment"] = 1 }, "segment"},
		{"negative segment index", func(m map[string]any) { region(m, 0, 0)["segment"] = -1 }, "segment"},
		{"negative offset", func(m map[string]any) { region(m, 0, 0)["offset"] = -1 }, "offset"},
		{"block_bytes 0", func(m map[string]any) { region(m, 0, 0)["block_bytes"] = 0 }, "block_bytes"},
		{"block_stride under block_bytes", func(m map[string]any) { region(m, 1, 0)["block_stride"] = 4095 }, "block_stride"},
		{"region end overflows", func(m map[string]any) { region(m, 0, 0)["block_stride"] = int64(1) << 60 }, "overflows"},
		{"no segments", func(m map[string]any) { m["segments"] = []any{} }, "segments"},
		{"segment with neither kind", func(m map[string]any) { m["segments"] = []any{map[string]any{}} }, "neither"},
		{"segment with both kinds", func(m map[string]any) { segment(m, 0)["cuda_ipc"] = strings.Repeat("00", 64) }, "both"},
		{"shm name with a slash", func(m map[string]any) { segment(m, 0)["shm"] = "../etc/passwd" }, "plain file name"},
		{"shm name dot-dot", func(m map[string]any) { segment(m, 0)["shm"] = ".." }, "plain file name"},
		{"cuda_ipc too short", func(m map[string]any) {
			m["segments"] = []any{map[string]any{"cuda_ipc": strings.Repeat("00", 63), "bytes": 1}}
		}, "cuda_ipc"},
		{"cuda_ipc not hex", func(m map[string]any) {
			m["segments"] = []any{map[string]any{"cuda_ipc": strings.Repeat("zz", 64), "bytes": 1}}
		}, "cuda_ipc"},
		{"cuda_ipc without bytes", func(m map[string]any) {
			m["segments"] = []any{map[string]any{"cuda_ipc": strings.Repeat("00", 64)}}
		}, "bytes"},
		{"wrong JSON type", func(m map[string]any) { m["tokens_per_hash"] = "4" }, "tokens_per_hash"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeSpec(specWith(t, tc.edit), Limits{})
			require.ErrorIs(t, err, ErrBadSpec)
			require.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestDecodeSpecRejectsBadJSON(t *testing.T) {
	for name, body := range map[string]string{
		"empty":          ``,
		"not an object":  `[1]`,
		"null":           `null`,
		"invalid JSON":   `{"tokens_per_hash":}`,
		"trailing data":  protocolSpec + `{}`,
		"invalid UTF-8":  "{\"segments\":[{\"shm\":\"\xff\"}]}",
		"wrong type key": `{"groups":{}}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeSpec([]byte(body), Limits{})
			require.ErrorIs(t, err, ErrBadSpec)
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}

func TestDecodeSpecErrorNamesThePath(t *testing.T) {
	_, err := DecodeSpec(specWith(t, func(m map[string]any) { region(m, 1, 0)["block_bytes"] = 0 }), Limits{})
	require.ErrorContains(t, err, "groups[1]: regions[0]: ")
}

// PROTOCOL.md "Isolation": engine e1 may name e1-kv or e1.kv, never e2-kv;
// the check is on the name alone, before anything is opened.
func TestCheckOwner(t *testing.T) {
	for _, tc := range []struct {
		engine, shm string
		ok          bool
	}{
		{"e1", "e1-kv", true},
		{"e1", "e1.kv", true},
		{"e1", "e1-", true},
		{"e1", "e1", false},
		{"e1", "e2-kv", false},
		{"e1", "e10-kv", false},
		{"e1", "kvactors-e1", false},
		{"e1", "E1-kv", false},
		{"e1", "e1_kv", false},
		{"vic", "vic-kv", true},
		{"mal", "vic-kv", false},
	} {
		s := messages.EngineSpec{Segments: []messages.Segment{{Shm: tc.engine + "-ok"}, {Shm: tc.shm}}}
		err := CheckOwner(tc.engine, &s)
		if tc.ok {
			require.NoError(t, err, "%s may name %q", tc.engine, tc.shm)
			continue
		}
		require.ErrorIs(t, err, ErrBadSpec, "%s may not name %q", tc.engine, tc.shm)
		require.ErrorContains(t, err, "segments[1]")
	}
	ipc := messages.EngineSpec{Segments: []messages.Segment{{CUDAIPC: "ab", Bytes: 1}}}
	require.NoError(t, CheckOwner("e1", &ipc), "the name rule is for shm segments")
}

// PROTOCOL.md "Isolation": namespace is 1..128 bytes (absent: the engine
// id); max_model_len is >= 0.
func TestDecodeSpecNamespaceAndMaxModelLen(t *testing.T) {
	s, err := DecodeSpec(specWith(t, func(m map[string]any) {
		m["namespace"] = "llama-3-70b/fp8/tp8 ✓"
		m["max_model_len"] = 8192
	}), Limits{})
	require.NoError(t, err)
	require.Equal(t, "llama-3-70b/fp8/tp8 ✓", Namespace("e1", &s))
	require.Equal(t, 8192, s.MaxModelLen)
	s.Namespace = ""
	require.Equal(t, "e1", Namespace("e1", &s), "default: the engine id")
	for name, edit := range map[string]func(m map[string]any){
		"namespace of 129 bytes": func(m map[string]any) { m["namespace"] = strings.Repeat("n", 129) },
		"negative max_model_len": func(m map[string]any) { m["max_model_len"] = -1 },
		"namespace not a string": func(m map[string]any) { m["namespace"] = 7 },
	} {
		_, err := DecodeSpec(specWith(t, edit), Limits{})
		require.ErrorIs(t, err, ErrBadSpec, name)
	}
	_, err = DecodeSpec(specWith(t, func(m map[string]any) { m["namespace"] = strings.Repeat("n", 128) }), Limits{})
	require.NoError(t, err, "128 bytes is the bound")
	// A lone surrogate escape would be replaced by U+FFFD, so "\ud800" and
	// "\udfff" would share a namespace: refused, as in request ids.
	body := specWith(t, func(m map[string]any) { m["namespace"] = "NS" })
	_, err = DecodeSpec(bytes.Replace(body, []byte(`"NS"`), []byte(`"ns-\ud800"`), 1), Limits{})
	require.ErrorIs(t, err, ErrBadSpec, "lone surrogate")
	s, err = DecodeSpec(bytes.Replace(body, []byte(`"NS"`), []byte(`"ns-\ud83d\ude00"`), 1), Limits{})
	require.NoError(t, err, "a surrogate pair is a character")
	require.Equal(t, "ns-😀", s.Namespace)
}

// EngineSpec "node" is a node id or absent (docs/PROTOCOL.md "EngineSpec"):
// a node's logs and refusals carry it, so an unbounded one is refused, and
// never echoed whole.
func TestDecodeSpecNodeIsANodeID(t *testing.T) {
	for _, ok := range []string{"", "gpu-7", "n_0", strings.Repeat("n", 64)} {
		s, err := DecodeSpec(specWith(t, func(m map[string]any) { m["node"] = ok }), Limits{})
		require.NoError(t, err, "%q", ok)
		require.Equal(t, ok, s.Node)
	}
	for _, bad := range []string{strings.Repeat("n", 65), strings.Repeat("x", 512<<10), "_n", "gpu.7", "a b", "gpu-7>"} {
		_, err := DecodeSpec(specWith(t, func(m map[string]any) { m["node"] = bad }), Limits{})
		require.ErrorIs(t, err, ErrBadSpec, "%.70q", bad)
		require.ErrorContains(t, err, "node")
		require.Less(t, len(err.Error()), 300, "the refusal does not echo the name whole")
	}
}
