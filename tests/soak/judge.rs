//! The soak's verdict on a series of samples, pure: growth is a last third that rises above the
//! middle third by more than the series' slack (the first third is the warm-up: pools fill,
//! autovacuum starts, caches settle, and is not judged).

/// How far a series may rise from its middle third to its last: `ratio` of the middle third's
/// highest sample, plus `absolute` (in the series' unit), so a small series' noise is not growth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slack {
    pub ratio: f64,
    pub absolute: f64,
}

impl Slack {
    pub const fn new(ratio: f64, absolute: f64) -> Self {
        Self { ratio, absolute }
    }
}

/// The fewest samples a series is judged on (two in each third).
pub const JUDGED_FROM: usize = 6;

/// Why `series` grew, or `None` if its last third stays within `slack` of its middle third's
/// highest sample. Panics below [`JUDGED_FROM`] samples: a soak too short to judge is a
/// configuration error, not a pass.
pub fn growth(series: &[f64], slack: Slack) -> Option<String> {
    assert!(
        series.len() >= JUDGED_FROM,
        "{} samples: a soak judges growth on {JUDGED_FROM} or more",
        series.len()
    );
    let third = series.len() / 3;
    let middle = highest(&series[third..series.len() - third]);
    let last = highest(&series[series.len() - third..]);
    let allowed = middle * (1.0 + slack.ratio) + slack.absolute;
    (last > allowed).then(|| {
        format!("rose to {last:.1} in the last third, above {allowed:.1} (the middle third's {middle:.1} with its slack)")
    })
}

/// Why any sample is above `bound` (the first too: lag has no warm-up), or `None`.
pub fn above(series: &[f64], bound: f64) -> Option<String> {
    series
        .iter()
        .enumerate()
        .find(|(_, value)| value.is_nan() || **value > bound)
        .map(|(at, value)| format!("sample {at} is {value:.1}, above its bound {bound:.1}"))
}

fn highest(samples: &[f64]) -> f64 {
    samples.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const TIGHT: Slack = Slack::new(0.1, 1.0);

    #[test]
    fn a_warm_up_then_a_plateau_is_not_growth() {
        let series = [1.0, 50.0, 90.0, 100.0, 99.0, 100.0, 101.0, 100.0, 98.0];
        assert_eq!(growth(&series, TIGHT), None);
    }

    #[test]
    fn a_steady_rise_is_growth_and_says_by_how_much() {
        let series: Vec<f64> = (0..12).map(|at| 100.0 + 10.0 * at as f64).collect();
        let why = growth(&series, TIGHT).expect("a leak of 10 per sample");
        assert!(why.contains("rose to 210.0"), "{why}");
    }

    #[test]
    fn the_slack_decides_at_its_edge() {
        // Middle third's highest 100: 100 x 1.1 + 1 = 111 allowed.
        let at_edge = [0.0, 0.0, 100.0, 100.0, 111.0, 111.0];
        assert_eq!(growth(&at_edge, TIGHT), None);
        let over = [0.0, 0.0, 100.0, 100.0, 111.0, 111.5];
        assert!(growth(&over, TIGHT).is_some());
    }

    #[test]
    #[should_panic(expected = "a soak judges growth on 6 or more")]
    fn too_few_samples_are_refused() {
        growth(&[1.0; 5], TIGHT);
    }

    #[test]
    fn a_bound_is_judged_on_every_sample_and_a_missing_one_breaks_it() {
        assert_eq!(above(&[5.0, 10.0, 5.0], 10.0), None);
        let why = above(&[11.0, 5.0, 5.0], 10.0).unwrap();
        assert!(why.starts_with("sample 0 is 11.0"), "{why}");
        assert!(
            above(&[5.0, f64::NAN], 10.0).is_some(),
            "NaN is not within a bound"
        );
    }

    proptest! {
        /// Any series whose later samples never exceed its middle third's highest passes, and
        /// any series whose last sample exceeds the slack over everything before it fails.
        #[test]
        fn growth_is_judged_on_the_middle_and_last_thirds(
            series in prop::collection::vec(0.0f64..1e6, JUDGED_FROM..60),
            leak in 0.0f64..1e6,
        ) {
            let third = series.len() / 3;
            let middle = highest(&series[third..series.len() - third]);
            let mut flat = series.clone();
            for value in &mut flat[series.len() - third..] {
                *value = value.min(middle);
            }
            prop_assert_eq!(growth(&flat, TIGHT), None);
            let mut leaking = series.clone();
            let top = highest(&series);
            *leaking.last_mut().unwrap() = top * 1.1 + 1.0 + leak + 1e-3;
            prop_assert!(growth(&leaking, TIGHT).is_some());
        }
    }
}
