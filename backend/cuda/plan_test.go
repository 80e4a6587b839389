package cuda

import (
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// handleHex is a well-formed (if meaningless) IPC handle.
var handleHex = strings.Repeat("0a", ipcHandleSize)

func TestParseSegments(t *testing.T) {
	good := messages.Segment{CUDAIPC: handleHex, Device: 1, Bytes: 4096}
	segs, err := parseSegments(1, []messages.Segment{good, {CUDAIPC: strings.ToUpper(handleHex), Device: 1, Bytes: 1}})
	require.NoError(t, err)
	require.Len(t, segs, 2)
	require.Equal(t, int64(4096), segs[0].bytes)
	require.Equal(t, byte(0x0a), segs[0].handle[ipcHandleSize-1])
	require.Equal(t, segs[0].handle, segs[1].handle, "hex is case-insensitive")

	for _, tc := range []struct {
		name string
		seg  messages.Segment
		want string
	}{
		{"shm", messages.Segment{Shm: "kvactors-e1"}, "needs the shm backend"},
		{"shm and ipc", messages.Segment{Shm: "x", CUDAIPC: handleHex, Device: 1, Bytes: 1}, "needs the shm backend"},
		{"empty", messages.Segment{}, "no cuda_ipc handle"},
		{"other device", messages.Segment{CUDAIPC: handleHex, Device: 0, Bytes: 1}, "on device 0"},
		{"zero bytes", messages.Segment{CUDAIPC: handleHex, Device: 1}, "bytes 0"},
		{"negative bytes", messages.Segment{CUDAIPC: handleHex, Device: 1, Bytes: -5}, "bytes -5"},
		{"short handle", messages.Segment{CUDAIPC: handleHex[2:], Device: 1, Bytes: 1}, "126 hex digits"},
		{"long handle", messages.Segment{CUDAIPC: handleHex + "00", Device: 1, Bytes: 1}, "130 hex digits"},
		{"not hex", messages.Segment{CUDAIPC: "zz" + handleHex[2:], Device: 1, Bytes: 1}, "invalid byte"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseSegments(1, []messages.Segment{good, tc.seg})
			require.ErrorIs(t, err, backend.ErrBadSegment)
			require.ErrorContains(t, err, "segment 1")
			require.ErrorContains(t, err, tc.want)
		})
	}

	_, err = parseSegments(0, nil)
	require.ErrorIs(t, err, backend.ErrBadSegment)
	require.ErrorContains(t, err, "no segments")
}

type rng = backend.Range

func TestPlanMerges(t *testing.T) {
	sizes := []int64{1 << 20, 1 << 20}
	for _, tc := range []struct {
		name   string
		in     []rng
		want   []rng
		reason string
	}{
		{"nothing", nil, []rng{}, ""},
		{"zero lengths dropped", []rng{{Len: 0}, {Segment: 1, SegOffset: 5, PoolOff: 7, Len: 0}}, []rng{}, ""},
		{
			"adjacent in both memories", []rng{
				{Segment: 0, SegOffset: 0, PoolOff: 100, Len: 10},
				{Segment: 0, SegOffset: 10, PoolOff: 110, Len: 20},
				{Segment: 0, SegOffset: 30, PoolOff: 130, Len: 5},
			},
			[]rng{{Segment: 0, SegOffset: 0, PoolOff: 100, Len: 35}}, "one DMA",
		},
		{
			"an empty range between does not split", []rng{
				{SegOffset: 0, PoolOff: 0, Len: 10},
				{SegOffset: 500, PoolOff: 500, Len: 0},
				{SegOffset: 10, PoolOff: 10, Len: 10},
			},
			[]rng{{SegOffset: 0, PoolOff: 0, Len: 20}}, "",
		},
		{
			"adjacent on the device only", []rng{
				{SegOffset: 0, PoolOff: 0, Len: 10},
				{SegOffset: 10, PoolOff: 20, Len: 10},
			},
			[]rng{{SegOffset: 0, PoolOff: 0, Len: 10}, {SegOffset: 10, PoolOff: 20, Len: 10}}, "",
		},
		{
			"adjacent in the pool only", []rng{
				{SegOffset: 0, PoolOff: 0, Len: 10},
				{SegOffset: 20, PoolOff: 10, Len: 10},
			},
			[]rng{{SegOffset: 0, PoolOff: 0, Len: 10}, {SegOffset: 20, PoolOff: 10, Len: 10}}, "",
		},
		{
			"same offsets, other segment", []rng{
				{Segment: 0, SegOffset: 0, PoolOff: 0, Len: 10},
				{Segment: 1, SegOffset: 10, PoolOff: 10, Len: 10},
			},
			[]rng{{Segment: 0, SegOffset: 0, PoolOff: 0, Len: 10}, {Segment: 1, SegOffset: 10, PoolOff: 10, Len: 10}}, "",
		},
		{
			"reversed order is not reordered", []rng{
				{SegOffset: 10, PoolOff: 10, Len: 10},
				{SegOffset: 0, PoolOff: 0, Len: 10},
			},
			[]rng{{SegOffset: 10, PoolOff: 10, Len: 10}, {SegOffset: 0, PoolOff: 0, Len: 10}}, "",
		},
		{
			// Cross-layer layout: block b, region r at b*L*bb + r*bb, listed
			// block by block, region by region: a whole chunk is one range.
			"interleaved layers", crossLayer(3, 4, 4096),
			[]rng{{Segment: 0, SegOffset: 0, PoolOff: 0, Len: 3 * 4 * 4096}}, "",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := plan(tc.in, sizes, 1<<20)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

// crossLayer lists the ranges of one chunk of blocks blocks, layers regions
// each, whose layers sit back to back per block.
func crossLayer(blocks, layers int, bb int64) []rng {
	var out []rng
	for b := range blocks {
		for r := range layers {
			off := int64(b*layers+r) * bb
			out = append(out, rng{SegOffset: off, PoolOff: off, Len: bb})
		}
	}
	return out
}

func TestPlanOutOfRange(t *testing.T) {
	const seg, pool = 8192, 4096
	good := rng{Len: 16}
	for _, tc := range []struct {
		name string
		r    rng
	}{
		{"negative segment", rng{Segment: -1, Len: 1}},
		{"segment past the last", rng{Segment: 1, Len: 1}},
		{"negative SegOffset", rng{SegOffset: -1, Len: 1}},
		{"negative PoolOff", rng{PoolOff: -1, Len: 1}},
		{"negative Len", rng{Len: -1}},
		{"past segment end", rng{SegOffset: seg - 1, Len: 2}},
		{"empty past segment end", rng{SegOffset: seg + 1}},
		{"past arena end", rng{PoolOff: pool - 1, Len: 2}},
		{"empty past arena end", rng{PoolOff: pool + 1}},
		{"SegOffset+Len overflows", rng{SegOffset: math.MaxInt64, Len: 2}},
		{"PoolOff+Len overflows", rng{PoolOff: math.MaxInt64 - 1, Len: 2}},
		{"min int64 Len", rng{Len: math.MinInt64}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := plan([]rng{good, tc.r}, []int64{seg}, pool)
			require.ErrorIs(t, err, backend.ErrOutOfRange)
			require.ErrorContains(t, err, "range 1")
		})
	}
	got, err := plan([]rng{{SegOffset: seg, PoolOff: pool}}, []int64{seg}, pool)
	require.NoError(t, err, "an empty range at the very end is in bounds")
	require.Empty(t, got)
}
