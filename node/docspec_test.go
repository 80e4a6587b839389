package node_test

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// docEngineSpec is the JSON block docs/PROTOCOL.md gives as a whole
// EngineSpec, decoded strictly (a field name the node does not know fails).
func docEngineSpec(t *testing.T) (raw []byte, spec messages.EngineSpec) {
	t.Helper()
	data, err := os.ReadFile("../docs/PROTOCOL.md")
	require.NoError(t, err)
	text := string(data)
	i := strings.Index(text, "A whole EngineSpec")
	require.GreaterOrEqual(t, i, 0, "docs/PROTOCOL.md's EngineSpec example")
	start := strings.Index(text[i:], "```json\n")
	require.GreaterOrEqual(t, start, 0)
	body := text[i+start+len("```json\n"):]
	end := strings.Index(body, "```")
	require.GreaterOrEqual(t, end, 0)
	raw = []byte(body[:end])
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&spec), "the example names only fields the node knows")
	return raw, spec
}

// A port writes its register body from docs/PROTOCOL.md: the example there
// registers as it stands, on a segment as large as its regions need; and
// the shared contract's example segment name (kvactors-e1), which that
// section says the node refuses for e1, is refused as bad_spec.
func TestTheProtocolDocsEngineSpecExampleRegisters(t *testing.T) {
	t.Parallel()
	raw, spec := docEngineSpec(t)
	e := startNode(t)
	var size int64
	for _, g := range spec.Groups {
		for _, r := range g.Regions {
			size = max(size, r.Offset+int64(spec.NumGPUBlocks-1)*r.BlockStride+r.BlockBytes)
		}
	}
	require.Len(t, spec.Segments, 1)
	seg, err := shm.Create(e.dir, spec.Segments[0].Shm, size)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })

	msg, err := testkit.EngineRequest(e.nc, "e1", "kvactors.e1.register", raw, 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(msg.Data), `"ok":true`, "the doc's example is refused: %s", msg.Data)

	other, err := shm.Create(e.dir, "kvactors-e1", size)
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Remove() })
	shared := bytes.Replace(raw, []byte(`"e1-kv"`), []byte(`"kvactors-e1"`), 1)
	msg, err = testkit.EngineRequest(e.nc, "e1", "kvactors.e1.register", shared, 5*time.Second)
	require.NoError(t, err)
	var refused struct{ Error string }
	require.NoError(t, json.Unmarshal(msg.Data, &refused))
	require.Contains(t, refused.Error, `shm "kvactors-e1" is not engine "e1"'s`)
}
