//! The oldest waiting intent's age over the last minutes: samples kept by the console (a
//! bounded ring) and drawn as an inline SVG plot.
use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use maud::{Markup, html};

use super::readable::{age, clock};

/// Samples of the oldest waiting intent's age, one every `every`, the last `capacity` kept.
#[derive(Debug)]
pub struct LagHistory {
    every: Duration,
    capacity: usize,
    samples: VecDeque<(SystemTime, Duration)>,
}

/// A sample's point on the plot, and the sample (when, the age then).
type Plotted<'a> = ((f64, f64), &'a (SystemTime, Duration));

const WIDTH: f64 = 600.0;
const HEIGHT: f64 = 120.0;
const LEFT: f64 = 48.0;

impl LagHistory {
    pub fn new(every: Duration, capacity: usize) -> Self {
        Self {
            every,
            capacity: capacity.max(2),
            samples: VecDeque::with_capacity(capacity),
        }
    }

    /// How often a sample is taken.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// The time the plot spans when full.
    pub fn span(&self) -> Duration {
        self.every * (self.capacity as u32 - 1)
    }

    pub fn push(&mut self, at: SystemTime, oldest: Duration) {
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((at, oldest));
    }

    /// The plot's points: x from the left edge (the span before `now`) to the right (`now`),
    /// y from the bottom (0) to the top (the largest age sampled, at least 1 s).
    #[cfg(test)]
    fn points(&self, now: SystemTime) -> (Vec<(f64, f64)>, Duration) {
        let (plotted, top) = self.plotted(now);
        (plotted.into_iter().map(|(point, _)| point).collect(), top)
    }

    /// Each sample within the span with its point, and the plot's top.
    fn plotted(&self, now: SystemTime) -> (Vec<Plotted<'_>>, Duration) {
        let span = self.span().as_secs_f64();
        let top = self
            .samples
            .iter()
            .map(|(_, age)| *age)
            .max()
            .unwrap_or_default()
            .max(Duration::from_secs(1));
        let points = self
            .samples
            .iter()
            .filter_map(|sample| {
                let (at, age) = sample;
                let ago = now.duration_since(*at).unwrap_or_default().as_secs_f64();
                (ago <= span).then(|| {
                    let x = LEFT + (WIDTH - LEFT) * (1.0 - ago / span);
                    let y = HEIGHT - HEIGHT * age.as_secs_f64() / top.as_secs_f64();
                    (
                        ((x * 10.0).round() / 10.0, (y * 10.0).round() / 10.0),
                        sample,
                    )
                })
            })
            .collect();
        (points, top)
    }

    /// The plot, with a readout above it (the last sample and the highest) and each sample's
    /// time and value on its point (a tooltip: the pages carry no script).
    pub fn svg(&self, now: SystemTime) -> Markup {
        let (plotted, top) = self.plotted(now);
        let line: Vec<String> = plotted
            .iter()
            .map(|((x, y), _)| format!("{x},{y}"))
            .collect();
        let highest = plotted.iter().map(|(_, (_, age))| *age).max();
        html! {
            @match (plotted.last(), highest) {
                (Some((_, (at, last))), Some(highest)) => {
                    p .readout {
                        "Now " b { (age(*last)) } " (sampled " (clock(*at)) "); the highest in the plot "
                        b { (age(highest)) } "."
                    }
                    svg .lag xmlns="http://www.w3.org/2000/svg" width=(WIDTH) height={ (HEIGHT + 16.0) }
                        viewBox={ "0 0 " (WIDTH) " " (HEIGHT + 16.0) } role="img"
                        aria-label={ "oldest waiting intent, now " (age(*last)) ", at most " (age(top)) } {
                        line x1=(LEFT) y1="0" x2=(WIDTH) y2="0" {}
                        line x1=(LEFT) y1=(HEIGHT) x2=(WIDTH) y2=(HEIGHT) {}
                        text x="0" y="10" { (age(top)) }
                        text x="0" y=(HEIGHT) { "0" }
                        text x=(LEFT) y={ (HEIGHT + 14.0) } { "-" (age(self.span())) }
                        text x={ (WIDTH - 24.0) } y={ (HEIGHT + 14.0) } { "now" }
                        polyline points=(line.join(" ")) {}
                        @for ((x, y), (at, sampled)) in &plotted {
                            circle cx=(x) cy=(y) r="3" {
                                title { (clock(*at)) ": " (age(*sampled)) }
                            }
                        }
                    }
                }
                _ => p .note { "No sample yet." },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_last_samples_and_the_plot_spans_them() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut lag = LagHistory::new(Duration::from_secs(5), 4);
        for n in 0..6u64 {
            lag.push(start + Duration::from_secs(5 * n), Duration::from_secs(n));
        }
        let now = start + Duration::from_secs(25);
        let (points, top) = lag.points(now);
        // Samples 2..=5 kept: 15 s ago at the left edge, now at the right; 5 s at the top.
        assert_eq!(top, Duration::from_secs(5));
        assert_eq!(
            points,
            [(LEFT, 72.0), (232.0, 48.0), (416.0, 24.0), (WIDTH, 0.0)]
        );
        let svg = lag.svg(now).into_string();
        assert!(
            svg.contains("<polyline points=\"48,72 232,48 416,24 600,0\"></polyline>"),
            "{svg}"
        );
        // SVG in HTML has no void elements: every one is closed.
        assert!(
            svg.contains("<line x1=\"48\" y1=\"0\" x2=\"600\" y2=\"0\"></line>"),
            "{svg}"
        );
    }

    #[test]
    fn an_idle_relay_plots_a_flat_line_under_one_second() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let mut lag = LagHistory::new(Duration::from_secs(5), 3);
        assert!(lag.svg(now).into_string().contains("No sample yet"));
        lag.push(now, Duration::ZERO);
        let (points, top) = lag.points(now);
        assert_eq!(
            (points, top),
            (vec![(WIDTH, HEIGHT)], Duration::from_secs(1))
        );
    }

    #[test]
    fn the_plot_reads_out_the_last_and_highest_sample_and_each_point() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut lag = LagHistory::new(Duration::from_secs(5), 4);
        for (n, secs) in [3u64, 42, 7].into_iter().enumerate() {
            lag.push(
                start + Duration::from_secs(5 * n as u64),
                Duration::from_secs(secs),
            );
        }
        let svg = lag.svg(start + Duration::from_secs(10)).into_string();
        assert!(
            svg.contains("Now <b>7 s</b> (sampled 2027-01-15 08:00:10 UTC); the highest in the plot <b>42 s</b>."),
            "{svg}"
        );
        assert!(
            svg.contains("<title>2027-01-15 08:00:05 UTC: 42 s</title>"),
            "{svg}"
        );
    }
}
