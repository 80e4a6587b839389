package tailbuf

import (
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestBufferKeepsTheLastBytes(t *testing.T) {
	b := &Buffer{Max: 10}
	_, _ = b.Write([]byte("0123456789"))
	require.Equal(t, "0123456789", b.String())
	_, _ = b.Write([]byte("abcdefghij")) // 20 bytes: at 2×Max, nothing dropped yet
	require.Equal(t, "0123456789abcdefghij", b.String())
	n, err := b.Write([]byte("K"))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, "[11 bytes dropped]\nbcdefghijK", b.String(), "past 2×Max: the last Max kept")
	for range 1000 {
		_, _ = b.Write([]byte("xy"))
	}
	require.LessOrEqual(t, len(b.buf), 2*b.Max)
	require.True(t, strings.HasSuffix(b.String(), "xyxyxyxyxy"))
	require.Equal(t, int64(2021), b.dropped+int64(len(b.buf)), "every byte written kept or counted as dropped")
}

func TestBufferTakesConcurrentWriters(t *testing.T) {
	b := &Buffer{Max: 64}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 500 {
				_, _ = b.Write([]byte("line\n"))
				_ = b.String()
			}
		})
	}
	wg.Wait()
	require.True(t, strings.HasSuffix(b.String(), "line\nline\n"))
}
