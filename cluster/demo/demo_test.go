package demo

import (
	"bytes"
	"context"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// Two nodes: every prefix crosses, every byte is compared (Run fails on a
// difference), and the counts add up.
func TestRunTwoNodesChecksEveryRemoteByte(t *testing.T) {
	var out bytes.Buffer
	res, err := Run(context.Background(), Options{Nodes: 2, Engines: 1, Prefixes: 2, Chunks: 3, BlockBytes: 4096,
		ShmDir: t.TempDir()}, &out)
	t.Log(out.String())
	require.NoError(t, err)
	require.Equal(t, 2*2*3, res.Stored)
	require.Equal(t, 4, res.Loads)
	require.Equal(t, 12, res.RemoteChunks, "each engine fetched every chunk of the other's prefixes")
	require.Equal(t, 12, res.Checked)
	require.Len(t, res.Nodes, 2)
}

// The extra latency a remote hit adds to a load, by chunk size (loads of
// 8 chunks fetched from another node against loads of the same chunks
// already in the local pool). Run by hand:
//
//	KVACTORS_MEASURE=1 go test ./cluster/demo -run Measure -v
func TestMeasureRemoteLoadLatency(t *testing.T) {
	if os.Getenv("KVACTORS_MEASURE") == "" {
		t.Skip("set KVACTORS_MEASURE=1")
	}
	for _, size := range []int64{64 << 10, 1 << 20, 4 << 20} {
		res, err := Run(context.Background(), Options{Nodes: 3, Engines: 2, Prefixes: 2, Chunks: 8, BlockBytes: size,
			ShmDir: t.TempDir()}, io.Discard)
		require.NoError(t, err)
		t.Logf("chunk %4d KiB: remote %s | local %s", size>>10, quantiles(res.RemoteLoads), quantiles(res.LocalLoads))
	}
}
