package replay_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/novox/mesh-provisioner/replay"
)

// TestParsePoint: CONTRACT section 3, at is "an RFC 3339 time or seq:<n>": every form of RFC 3339's
// date-time (section 5.6: offsets, fractions of any length, lower-case t and z, the leap second) is a
// point, and nothing else is.
func TestParsePoint(t *testing.T) {
	t.Parallel()
	utc := func(s string) time.Time {
		tm, err := time.Parse(time.RFC3339Nano, s)
		require.NoError(t, err)
		return tm
	}
	good := []struct {
		in   string
		want replay.Point
	}{
		{"seq:0", replay.Point{}},
		{"seq:42", replay.Point{Seq: 42}},
		{"2026-11-02T03:12:00Z", replay.Point{Time: utc("2026-11-02T03:12:00Z")}},
		{"2026-11-02t03:12:00z", replay.Point{Time: utc("2026-11-02T03:12:00Z")}},
		{"2026-11-02T05:42:00+02:30", replay.Point{Time: utc("2026-11-02T03:12:00Z")}},
		{"2026-11-01T20:12:00-07:00", replay.Point{Time: utc("2026-11-02T03:12:00Z")}},
		{"2026-11-02T03:12:00-00:00", replay.Point{Time: utc("2026-11-02T03:12:00Z")}},
		{"2026-11-02T03:12:00.5Z", replay.Point{Time: utc("2026-11-02T03:12:00.5Z")}},
		{"2026-11-02T03:12:00.123456789Z", replay.Point{Time: utc("2026-11-02T03:12:00.123456789Z")}},
		{"2026-11-02T03:12:00.1234567891234Z", replay.Point{Time: utc("2026-11-02T03:12:00.123456789Z")}},
		{"2026-11-02T03:12:00.000+23:59", replay.Point{Time: utc("2026-11-01T03:13:00Z")}},
		// The leap second is the last instant of the second before it, with or without a fraction.
		{"2016-12-31T23:59:60Z", replay.Point{Time: utc("2016-12-31T23:59:59.999999999Z")}},
		{"2016-12-31T23:59:60.5Z", replay.Point{Time: utc("2016-12-31T23:59:59.999999999Z")}},
		{"2017-01-01T00:59:60+01:00", replay.Point{Time: utc("2016-12-31T23:59:59.999999999Z")}},
		{"2016-12-31T15:59:60-08:00", replay.Point{Time: utc("2016-12-31T23:59:59.999999999Z")}},
		{"2015-06-30T23:59:60z", replay.Point{Time: utc("2015-06-30T23:59:59.999999999Z")}},
		{"2026-02-28T23:59:60Z", replay.Point{Time: utc("2026-02-28T23:59:59.999999999Z")}}, // any month's end
		{"9999-12-31T23:59:60Z", replay.Point{Time: utc("9999-12-31T23:59:59.999999999Z")}},
		// The edges of the grammar: -00:00 (UTC, local offset unknown), the widest offsets, years
		// 0000 and 9999, February 29 of leap years.
		{"2026-11-02T03:12:00-23:59", replay.Point{Time: utc("2026-11-03T03:11:00Z")}},
		{"0000-01-01T00:00:00Z", replay.Point{Time: utc("0000-01-01T00:00:00Z")}},
		{"9999-12-31T23:59:59.999999999Z", replay.Point{Time: utc("9999-12-31T23:59:59.999999999Z")}},
		{"2024-02-29T00:00:00Z", replay.Point{Time: utc("2024-02-29T00:00:00Z")}},
		{"2000-02-29T00:00:00Z", replay.Point{Time: utc("2000-02-29T00:00:00Z")}},
		{"2026-11-02T03:12:00.9999999999Z", replay.Point{Time: utc("2026-11-02T03:12:00.999999999Z")}}, // cut, not rounded
	}
	for _, tc := range good {
		p, err := replay.ParsePoint(tc.in)
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want.Seq, p.Seq, tc.in)
		require.True(t, tc.want.Time.Equal(p.Time), "%s: %v, want %v", tc.in, p.Time, tc.want.Time)
	}
	for _, in := range []string{
		"", "seq:", "seq:-1", "seq:+1", "seq:x", "seq:1.5", "seq: 1", "SEQ:1", "seq:18446744073709551615",
		"yesterday", "1700000000", "2026-11-02", "2026-11-02T03:12:00", "2026-11-02T03:12Z",
		"2026-11-02 03:12:00Z", "2026-11-02_03:12:00Z", " 2026-11-02T03:12:00Z", "2026-11-02T03:12:00Z ",
		"2026-11-02T03:12:00,5Z", // a comma before the fraction: ISO 8601's, not RFC 3339's
		"2026-11-02T03:12:00.Z", "2026-11-02T03:12:00.5", "2026-11-02T03:12:00ZZ",
		"2026-11-02T03:12:00+24:00", "2026-11-02T03:12:00+02:60", "2026-11-02T03:12:00+0200", "2026-11-02T03:12:00+2",
		"2026-11-02T03:12:00UTC", "2026-11-02T03:12:00 Z",
		"+2026-11-02T03:12:00Z", "20260-11-02T03:12:00Z", "226-11-02T03:12:00Z",
		"2026-13-02T03:12:00Z", "2026-02-30T03:12:00Z", "2026-11-02T24:00:00Z", "2026-11-02T03:60:00Z", "2026-11-02T03:12:61Z",
		"２026-11-02T03:12:00Z", // a full-width digit
		// The second 60 where no leap second can fall (RFC 3339 section 5.7): not the last minute
		// of a month in UTC.
		"2026-11-02T03:12:60Z", "2026-11-02T23:59:60Z", "2016-12-31T23:58:60Z", "2016-12-31T23:59:60+01:00",
		"2016-12-31T23:59:60.5-00:01", "2026-11-02T03:59:60+04:00", "2016-12-31T23:59:61Z",
		"2026-04-31T00:00:00Z", "2026-02-29T00:00:00Z", "1900-02-29T00:00:00Z", "2026-00-01T00:00:00Z",
		"2026-01-00T00:00:00Z", "2026-11-02T03:12:00Z\n", "\t2026-11-02T03:12:00Z", "2026-11-02T03:12:00.5\u00a0Z",
		"2026-11-02T03:12:00+23:60", "2026-11-02T03:12:00-24:00",
	} {
		_, err := replay.ParsePoint(in)
		require.Error(t, err, "%q is no point", in)
	}
}
