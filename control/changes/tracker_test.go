package changes

import (
	"reflect"
	"sync"
	"testing"
	"time"
)

// The values are pointers, as the converted objects are; nil is absent.
func eq(a, b *string) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func s(v string) *string { return &v }

type update struct {
	key        string
	prev, curr *string
}

func TestTracker(t *testing.T) {
	testCases := []struct {
		name        string
		updates     []update
		wantPending []int                 // after each update
		wantChanged []bool                // each update's own answer
		want        map[string][2]*string // key -> previous, current
	}{
		{
			name:        "add",
			updates:     []update{{"a", nil, s("1")}},
			wantPending: []int{1},
			wantChanged: []bool{true},
			want:        map[string][2]*string{"a": {nil, s("1")}},
		},
		{
			name:        "add then delete ends where it began",
			updates:     []update{{"a", nil, s("1")}, {"a", s("1"), nil}},
			wantPending: []int{1, 0},
			wantChanged: []bool{true, true},
		},
		{
			name:        "updates are folded: previous is fixed by the first",
			updates:     []update{{"a", s("1"), s("2")}, {"a", s("2"), s("3")}},
			wantPending: []int{1, 1},
			wantChanged: []bool{true, true},
			want:        map[string][2]*string{"a": {s("1"), s("3")}},
		},
		{
			name:        "update undone",
			updates:     []update{{"a", s("1"), s("2")}, {"b", nil, s("x")}, {"a", s("2"), s("1")}},
			wantPending: []int{1, 2, 1},
			wantChanged: []bool{true, true, true},
			want:        map[string][2]*string{"b": {nil, s("x")}},
		},
		{
			name:        "update to an equal value is no change",
			updates:     []update{{"a", s("1"), s("1")}},
			wantPending: []int{0},
			wantChanged: []bool{false},
		},
		{
			name:        "delete and re-add with other content",
			updates:     []update{{"a", s("1"), nil}, {"a", nil, s("2")}},
			wantPending: []int{1, 1},
			wantChanged: []bool{true, true},
			want:        map[string][2]*string{"a": {s("1"), s("2")}},
		},
		{
			name:        "a repeat of a pending change is no change, but the other change stays pending",
			updates:     []update{{"a", s("1"), s("2")}, {"b", s("x"), s("x")}, {"a", s("2"), s("2")}},
			wantPending: []int{1, 1, 1},
			wantChanged: []bool{true, false, false},
			want:        map[string][2]*string{"a": {s("1"), s("2")}},
		},
		{
			name:        "delete of something never seen",
			updates:     []update{{"a", nil, nil}},
			wantPending: []int{0},
			wantChanged: []bool{false},
		},
	}
	for _, tc := range testCases {
		t.Run(tc.name, func(t *testing.T) {
			tr := New[string](eq)
			for i, u := range tc.updates {
				pending, changed := tr.Update(u.key, u.prev, u.curr, time.Time{})
				if pending != tc.wantPending[i] || changed != tc.wantChanged[i] {
					t.Errorf("update %d: pending %d, changed %v; want %d, %v", i, pending, changed, tc.wantPending[i], tc.wantChanged[i])
				}
			}
			changes, _ := tr.Checkout()
			got := map[string][2]*string{}
			for k, c := range changes {
				got[k] = [2]*string{c.Previous, c.Current}
			}
			if len(got) != len(tc.want) {
				t.Fatalf("changes %v, want %v", got, tc.want)
			}
			for k, w := range tc.want {
				g, ok := got[k]
				if !ok || !eq(g[0], w[0]) || !eq(g[1], w[1]) {
					t.Errorf("change of %s: got %v, want %v", k, g, w)
				}
			}
			if tr.Pending() != 0 {
				t.Errorf("pending %d after checkout", tr.Pending())
			}
		})
	}
}

func TestTrackerTriggerTimes(t *testing.T) {
	tr := New[string](eq)
	t1 := time.Date(2026, 1, 1, 0, 0, 1, 0, time.UTC)
	t2 := t1.Add(time.Second)
	tr.Update("a", nil, s("1"), t1)
	tr.Update("a", s("1"), s("2"), t2)
	tr.Update("b", nil, s("1"), t1)
	tr.Update("b", s("1"), nil, t2) // b ends where it began: its triggers go
	changes, triggers := tr.Checkout()
	if len(changes) != 1 {
		t.Fatalf("changes %v", changes)
	}
	if !reflect.DeepEqual(triggers, []time.Time{t1, t2}) {
		t.Fatalf("triggers %v, want [%v %v]", triggers, t1, t2)
	}
	// Checked out changes are the new baseline.
	tr.Update("a", s("2"), s("2"), time.Time{})
	if c, tt := tr.Checkout(); c != nil || tt != nil {
		t.Fatalf("no-op update produced %v %v", c, tt)
	}
}

func TestTrackerConcurrentUpdates(t *testing.T) {
	tr := New[int](eq)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 1000 {
				k := w*1000 + i
				tr.Update(k, nil, s("x"), time.Time{})
				if i%2 == 0 {
					tr.Update(k, s("x"), nil, time.Time{})
				}
			}
		})
	}
	wg.Wait()
	changes, _ := tr.Checkout()
	if len(changes) != 2000 {
		t.Fatalf("%d changes, want 2000", len(changes))
	}
}
