package shm_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// sparse makes dir/name an object of size bytes that costs nothing (an
// ftruncate, as an engine could do on tmpfs), holding nothing the test
// maps: it reads and writes it with pread/pwrite, so any mapping of it in
// this process is the backend's.
func sparse(t *testing.T, dir, name string, size int64) *os.File {
	t.Helper()
	require.NoError(t, create(t, dir, name, 4096).Close()) // the name rule and clean-up; its mapping gone
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	require.NoError(t, f.Truncate(size))
	return f
}

// docs/SECURITY.md "Address space": AttachSpans maps only the pages of each
// segment's span, however large the object; copies address the segment as a
// whole and move the right bytes; a copy outside the span is refused.
func TestAttachSpansMapsOnlyTheSpan(t *testing.T) {
	dir := t.TempDir()
	page := int64(os.Getpagesize())
	const huge = 1 << 40 // 1 TiB, sparse
	f := sparse(t, dir, "e1-big", huge)
	span := backend.Span{Off: huge - 3*page + 100, End: huge - page + 10} // crosses 3 pages
	want := make([]byte, span.End-span.Off)
	for i := range want {
		want[i] = byte(i*7 + 1)
	}
	_, err := f.WriteAt(want, span.Off)
	require.NoError(t, err)

	b := newBackend(t, dir)
	dev, err := b.AttachSpans("e1", []messages.Segment{{Shm: "e1-big"}}, []backend.Span{span})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	require.Equal(t, []testkit.Mapping{{Off: huge - 3*page, Len: 3 * page}},
		testkit.Mappings(t, filepath.Join(dir, "e1-big")), "the span's pages, not the object's terabyte")
	require.Equal(t, int64(huge), dev.SegmentSize(0), "the segment's size is the object's")

	arena, err := b.AllocArena(2 * page)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, arena.Close()) })
	n := span.End - span.Off
	require.NoError(t, dev.Copy(backend.DeviceToHost, arena, []backend.Range{{SegOffset: span.Off, Len: n}}))
	require.Equal(t, want, arena.Bytes()[:n], "a store reads the span's bytes")

	copy(arena.Bytes()[page:], "loaded into the span")
	require.NoError(t, dev.Copy(backend.HostToDevice, arena,
		[]backend.Range{{SegOffset: span.End - 20, PoolOff: page, Len: 20}}))
	got := make([]byte, 20)
	_, err = f.ReadAt(got, span.End-20)
	require.NoError(t, err)
	require.Equal(t, "loaded into the span", string(got), "a load lands in the object")

	for _, r := range []backend.Range{
		{SegOffset: span.Off - 1, Len: 1},           // in the mapped page, before the span
		{SegOffset: span.End, Len: 1},               // in the mapped page, after the span
		{SegOffset: 0, Len: 1},                      // in the segment, not mapped
		{SegOffset: span.End - 1, Len: 2},           // runs out of the span
		{SegOffset: huge - 1, Len: 1 << 62},         // wraps
		{SegOffset: span.Off, Len: -1},              // negative
		{SegOffset: span.Off - huge, Len: huge + 1}, // negative offset
	} {
		err := dev.Copy(backend.DeviceToHost, arena, []backend.Range{r})
		require.ErrorIs(t, err, backend.ErrOutOfRange, "%+v", r)
	}
	require.ErrorContains(t, dev.Copy(backend.DeviceToHost, arena, []backend.Range{{Len: 1}}),
		"outside the mapped bytes")

	require.NoError(t, dev.Close())
	require.Empty(t, testkit.Mappings(t, filepath.Join(dir, "e1-big")), "Close unmaps the span")
}

// A span past the end of its object, or spans that do not match the
// segments, are refused and leave nothing mapped.
func TestAttachSpansRefuses(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, create(t, dir, "e1-a", 8192).Close())
	require.NoError(t, create(t, dir, "e1-b", 8192).Close())
	b := newBackend(t, dir)
	segs := []messages.Segment{{Shm: "e1-a"}, {Shm: "e1-b"}}
	for _, spans := range [][]backend.Span{
		{{Off: 0, End: 8192}, {Off: 4096, End: 8193}}, // past the end of e1-b
		{{Off: 0, End: 8192}, {Off: 10, End: 10}},     // empty
		{{Off: 0, End: 8192}, {Off: -1, End: 10}},     // negative
		{{Off: 0, End: 8192}},                         // one span for two segments
	} {
		_, err := b.AttachSpans("e1", segs, spans)
		require.ErrorIs(t, err, backend.ErrBadSegment, "%+v", spans)
		require.Empty(t, testkit.Mappings(t, filepath.Join(dir, "e1-a")), "e1-a unmapped again")
		require.Empty(t, testkit.Mappings(t, filepath.Join(dir, "e1-b")))
	}
	dev, err := b.AttachSpans("e1", segs, []backend.Span{{Off: 0, End: 8192}, {Off: 4096, End: 8192}})
	require.NoError(t, err)
	page := int64(os.Getpagesize())
	base := int64(4096) &^ (page - 1)
	require.Equal(t, []testkit.Mapping{{Off: base, Len: (8192+page-1)&^(page-1) - base}},
		testkit.Mappings(t, filepath.Join(dir, "e1-b")))
	require.NoError(t, dev.Close())
}
