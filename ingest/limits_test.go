package ingest

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestZeroLimitsMeanDefaults(t *testing.T) {
	require.Equal(t, DefaultLimits(), Limits{}.WithDefaults())
	require.NoError(t, Limits{}.Validate())
	require.NoError(t, DefaultLimits().Validate())
}

func TestWithDefaultsKeepsSetFields(t *testing.T) {
	l := Limits{MaxIDs: 7, MaxEvents: -1}.WithDefaults()
	require.Equal(t, 7, l.MaxIDs)
	require.Equal(t, -1, l.MaxEvents, "negative is kept for Validate to report")
	require.Equal(t, DefaultLimits().MaxGroups, l.MaxGroups)
}

func TestValidateRejects(t *testing.T) {
	for name, l := range map[string]Limits{
		"negative max_ids":                    {MaxIDs: -1},
		"negative max_groups":                 {MaxGroups: -3},
		"request ids over the protocol's 256": {MaxRequestIDBytes: 257},
		"negative max_hash_bytes":             {MaxHashBytes: -1},
		"huge max_hash_bytes":                 {MaxHashBytes: 1 << 20},
		"negative max_events":                 {MaxEvents: -1},
		"negative max_segments":               {MaxSegments: -1},
		"negative max_regions":                {MaxRegions: -1},
	} {
		t.Run(name, func(t *testing.T) {
			require.ErrorIs(t, l.Validate(), ErrBadLimits)
		})
	}
}

func TestLimitsJSONTags(t *testing.T) {
	var l Limits
	require.NoError(t, json.Unmarshal([]byte(`{"max_ids":5,"max_groups":2,"max_request_id_bytes":16,
		"max_hash_bytes":32,"max_events":10,"max_segments":3,"max_regions":4}`), &l))
	require.Equal(t, Limits{MaxIDs: 5, MaxGroups: 2, MaxRequestIDBytes: 16, MaxHashBytes: 32,
		MaxEvents: 10, MaxSegments: 3, MaxRegions: 4}, l)
}
