//! What a sweep adds after its blocks: a summary table (stdout) and an SVG plot of TTFT, TPOT
//! and throughput against the swept value (`plotters`, SVG backend, no system fonts needed).

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use crate::metrics::{BenchmarkMetrics, MetricKind};
use crate::report::percentile_word;

/// Which option a sweep varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepAxis {
    NumPrompts,
    RequestRate,
    MaxConcurrency,
}

impl SweepAxis {
    /// The option name, as a column header and axis label.
    pub fn label(self) -> &'static str {
        match self {
            Self::NumPrompts => "num_prompts",
            Self::RequestRate => "request_rate",
            Self::MaxConcurrency => "max_concurrency",
        }
    }
}

/// One finished block of a sweep.
#[derive(Debug, Clone)]
pub struct SweepPoint {
    pub value: f64,
    pub duration: f64,
    pub metrics: BenchmarkMetrics,
}

/// Why the plot could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write plot {path}: {message}")]
pub struct PlotError {
    pub path: String,
    pub message: String,
}

fn first_percentile(metrics: &BenchmarkMetrics, kind: MetricKind) -> Option<(f64, f64)> {
    metrics.stats(kind).percentiles.first().copied()
}

/// The summary table printed after a sweep's blocks.
pub fn summary_table(axis: SweepAxis, points: &[SweepPoint]) -> String {
    let p_word = points
        .first()
        .and_then(|p| first_percentile(&p.metrics, MetricKind::Ttft))
        .map_or_else(|| "99".to_string(), |(p, _)| percentile_word(p));
    let mut out = String::new();
    let _ = writeln!(out, "{:=^118}", " Sweep Summary ");
    let _ = writeln!(
        out,
        "{:>15} {:>9} {:>7} {:>9} {:>9} {:>11} {:>12} {:>12} {:>12} {:>12} {:>12}",
        axis.label(),
        "succeeded",
        "failed",
        "dur (s)",
        "req/s",
        "out tok/s",
        "mean TTFT",
        format!("P{p_word} TTFT"),
        "mean TPOT",
        format!("P{p_word} TPOT"),
        "mean ITL",
    );
    for point in points {
        let m = &point.metrics;
        let p = |kind| first_percentile(m, kind).map_or(0.0, |(_, v)| v);
        let _ = writeln!(
            out,
            "{:>15} {:>9} {:>7} {:>9.2} {:>9.2} {:>11.2} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>12.2}",
            crate::report::python_float(point.value).trim_end_matches(".0"),
            m.completed,
            m.failed,
            point.duration,
            m.request_throughput,
            m.output_throughput,
            m.stats(MetricKind::Ttft).mean,
            p(MetricKind::Ttft),
            m.stats(MetricKind::Tpot).mean,
            p(MetricKind::Tpot),
            m.stats(MetricKind::Itl).mean,
        );
    }
    let _ = writeln!(out, "{}", "=".repeat(118));
    out
}

struct Panel {
    title: &'static str,
    unit: &'static str,
    series: Vec<(String, Vec<f64>)>,
}

/// Writes an SVG with three panels (TTFT, TPOT, throughput) against the swept value. The x
/// axis is logarithmic (base 2) when the values span a factor of 8 or more.
pub fn write_plot(path: &Path, axis: SweepAxis, points: &[SweepPoint]) -> Result<(), PlotError> {
    let error = |message: String| PlotError {
        path: path.display().to_string(),
        message,
    };
    if points.is_empty() {
        return Err(error("no points".into()));
    }
    let xs: Vec<f64> = points.iter().map(|p| p.value).collect();
    let (x_min, x_max) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        });
    let log_x = x_min > 0.0 && x_max / x_min >= 8.0;
    let to_x = |x: f64| if log_x { x.log2() } else { x };
    let p_label = first_percentile(&points[0].metrics, MetricKind::Ttft).map_or_else(
        || "P99".to_string(),
        |(p, _)| format!("P{}", percentile_word(p)),
    );
    let column = |f: &dyn Fn(&BenchmarkMetrics) -> f64| -> Vec<f64> {
        points.iter().map(|p| f(&p.metrics)).collect()
    };
    let p_of = |kind| move |m: &BenchmarkMetrics| first_percentile(m, kind).map_or(0.0, |(_, v)| v);
    let panels = [
        Panel {
            title: "Time to first token",
            unit: "ms",
            series: vec![
                ("mean".into(), column(&|m| m.stats(MetricKind::Ttft).mean)),
                (
                    "median".into(),
                    column(&|m| m.stats(MetricKind::Ttft).median),
                ),
                (p_label.clone(), column(&p_of(MetricKind::Ttft))),
            ],
        },
        Panel {
            title: "Time per output token (excl. 1st)",
            unit: "ms",
            series: vec![
                ("mean".into(), column(&|m| m.stats(MetricKind::Tpot).mean)),
                (
                    "median".into(),
                    column(&|m| m.stats(MetricKind::Tpot).median),
                ),
                (p_label, column(&p_of(MetricKind::Tpot))),
            ],
        },
        Panel {
            title: "Throughput",
            unit: "tok/s",
            series: vec![
                ("output".into(), column(&|m| m.output_throughput)),
                ("total".into(), column(&|m| m.total_token_throughput)),
            ],
        },
    ];
    let root = SVGBackend::new(path, (960, 1080)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(e.to_string()))?;
    let (lo, hi) = (to_x(x_min), to_x(x_max));
    let pad = if hi > lo { (hi - lo) * 0.03 } else { 1.0 };
    let colors = [BLUE, RED, GREEN];
    for (area, panel) in root.split_evenly((3, 1)).iter().zip(panels) {
        let y_max = panel
            .series
            .iter()
            .flat_map(|(_, ys)| ys.iter().copied())
            .filter(|y| y.is_finite())
            .fold(0.0f64, f64::max);
        let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((lo - pad)..(hi + pad), 0.0..y_max)
            .map_err(|e| error(e.to_string()))?;
        let x_formatter = |x: &f64| {
            if log_x && x.fract().abs() > 1e-9 {
                // Ticks between powers of two would read 1.41, 2.83, …: leave them blank.
                return String::new();
            }
            let value = if log_x { x.exp2() } else { *x };
            format!("{}", (value * 100.0).round() / 100.0)
        };
        chart
            .configure_mesh()
            .x_desc(axis.label())
            .y_desc(panel.unit)
            .x_label_formatter(&x_formatter)
            .draw()
            .map_err(|e| error(e.to_string()))?;
        for ((name, ys), color) in panel.series.iter().zip(colors.iter().cycle()) {
            let data: Vec<(f64, f64)> = xs
                .iter()
                .map(|&x| to_x(x))
                .zip(ys.iter().copied())
                .collect();
            chart
                .draw_series(LineSeries::new(data.clone(), color.stroke_width(2)))
                .map_err(|e| error(e.to_string()))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    data.into_iter()
                        .map(|point| Circle::new(point, 3, color.filled())),
                )
                .map_err(|e| error(e.to_string()))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| error(e.to_string()))?;
    }
    root.present().map_err(|e| error(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Stats;

    fn point(value: f64, ttft_ms: f64) -> SweepPoint {
        let mut metrics = BenchmarkMetrics {
            completed: value as usize,
            output_throughput: 10.0 * value,
            total_token_throughput: 20.0 * value,
            ..Default::default()
        };
        for kind in MetricKind::ALL {
            metrics.stats.insert(
                kind,
                Stats {
                    mean: ttft_ms,
                    median: ttft_ms,
                    std: 0.0,
                    percentiles: vec![(99.0, ttft_ms * 2.0)],
                },
            );
        }
        SweepPoint {
            value,
            duration: 1.5,
            metrics,
        }
    }

    #[test]
    fn summary_has_one_row_per_value() {
        let points = vec![point(1.0, 10.0), point(2.0, 12.5), point(4.0, 20.0)];
        let table = summary_table(SweepAxis::NumPrompts, &points);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 6);
        assert!(lines[1].contains("num_prompts") && lines[1].contains("P99 TTFT"));
        let row: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(row[0], "2");
        assert_eq!(row[1], "2");
        assert_eq!(row[6], "12.50");
        assert_eq!(row[7], "25.00");
    }

    #[test]
    fn plot_is_an_svg_with_the_three_panels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sweep.svg");
        let points: Vec<_> = (0..6)
            .map(|k| point(f64::from(1 << k), 10.0 + k as f64))
            .collect();
        write_plot(&path, SweepAxis::NumPrompts, &points).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        for title in [
            "Time to first token",
            "Time per output token",
            "Throughput",
            "num_prompts",
        ] {
            assert!(svg.contains(title), "missing {title}");
        }
        // Log axis: the tick labels are the swept values, not their logarithms.
        assert!(svg.contains("\n32\n"), "x tick for 32 expected");
        assert!(!svg.contains("\n1.41\n"), "no ticks between powers of two");
    }
}
