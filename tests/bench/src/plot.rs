//! PNG charts for docs/, drawn with plotters (text in DejaVu Sans from
//! Debian's fonts-dejavu-core).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

pub fn register_fonts() -> anyhow::Result<()> {
    let bytes = std::fs::read(FONT)
        .with_context(|| format!("{FONT} (make bench installs fonts-dejavu-core)"))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("bad font {FONT}"))?;
    Ok(())
}

/// Admitted requests per second over time, one line per series.
pub fn rate_over_time(
    path: &Path,
    title: &str,
    target: f64,
    series: &[(&str, Vec<(f64, f64)>)],
) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let x_max = series
        .iter()
        .flat_map(|(_, s)| s.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let y_max = series
        .iter()
        .flat_map(|(_, s)| s.iter().map(|p| p.1))
        .fold(target, f64::max)
        * 1.25;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("admitted per second")
        .label_style(("sans-serif", 13))
        .draw()?;
    chart
        .draw_series(LineSeries::new(
            [(0.0, target), (x_max, target)],
            BLACK.stroke_width(1),
        ))?
        .label(format!("target {target:.0}/s"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    let colours = [BLUE, RED, GREEN];
    for (i, (name, points)) in series.iter().enumerate() {
        let colour = colours[i % colours.len()];
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()?;
    root.present()?;
    Ok(())
}

/// A histogram of `values` (ms) in `bucket_ms` buckets.
pub fn histogram(
    path: &Path,
    title: &str,
    x_desc: &str,
    values: &[f64],
    bucket_ms: f64,
) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let lo = values.iter().copied().fold(0.0, f64::min).floor();
    let hi = values.iter().copied().fold(1.0, f64::max).ceil() + bucket_ms;
    let buckets = ((hi - lo) / bucket_ms).ceil() as usize;
    let mut counts = vec![0u32; buckets.max(1)];
    for v in values {
        let i = (((v - lo) / bucket_ms) as usize).min(counts.len() - 1);
        counts[i] += 1;
    }
    let top = counts.iter().copied().max().unwrap_or(1) as f64 * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(lo..hi, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("requests")
        .label_style(("sans-serif", 13))
        .draw()?;
    chart.draw_series(counts.iter().enumerate().map(|(i, c)| {
        let x0 = lo + i as f64 * bucket_ms;
        Rectangle::new(
            [(x0, 0.0), (x0 + bucket_ms * 0.9, *c as f64)],
            BLUE.filled(),
        )
    }))?;
    root.present()?;
    Ok(())
}
