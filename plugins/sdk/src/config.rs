//! A small `key=value` config format for plugins, so that a plugin needs no JSON
//! parser: `"overlap_weight=1.0, temperature=0.5"` (commas, semicolons or newlines
//! between pairs). Unknown keys are errors, so a typo refuses the plugin at load.

use std::fmt;

/// A parsed config: every key must be read by the plugin before [`Config::finish`].
#[derive(Debug)]
pub struct Config {
    pairs: Vec<(String, String, bool)>,
}

/// Why a config was refused; converts into the `String` that `configure` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<ConfigError> for String {
    fn from(e: ConfigError) -> String {
        e.0
    }
}

impl Config {
    /// Parses `key=value` pairs; an empty string is an empty config.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut pairs: Vec<(String, String, bool)> = Vec::new();
        for item in text.split([',', ';', '\n']).map(str::trim) {
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| ConfigError(format!("config item {item:?} is not key=value")))?;
            let key = key.trim().to_string();
            if pairs.iter().any(|(k, _, _)| *k == key) {
                return Err(ConfigError(format!("config key {key:?} is given twice")));
            }
            pairs.push((key, value.trim().to_string(), false));
        }
        Ok(Config { pairs })
    }

    /// The value of `key` parsed as `T`, or `default` when the key is absent.
    pub fn get<T: std::str::FromStr>(&mut self, key: &str, default: T) -> Result<T, ConfigError> {
        let Some((_, value, used)) = self.pairs.iter_mut().find(|(k, _, _)| k == key) else {
            return Ok(default);
        };
        *used = true;
        value
            .parse()
            .map_err(|_| ConfigError(format!("config key {key:?}: cannot parse {value:?}")))
    }

    /// Fails on any key that no `get` asked for (a typo, or an option this
    /// version does not have).
    pub fn finish(self) -> Result<(), ConfigError> {
        let unknown: Vec<&str> = self
            .pairs
            .iter()
            .filter(|(_, _, used)| !used)
            .map(|(k, _, _)| k.as_str())
            .collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(ConfigError(format!(
                "unknown config keys: {}",
                unknown.join(", ")
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pairs_with_defaults_and_refuses_unknown_keys() {
        let mut c = Config::parse("a=1.5; b = 7,\n").unwrap();
        assert_eq!(c.get("a", 0.0f64).unwrap(), 1.5);
        assert_eq!(c.get("b", 0u32).unwrap(), 7);
        assert_eq!(c.get("missing", 42u32).unwrap(), 42);
        c.finish().unwrap();

        let mut c = Config::parse("a=1, typo=2").unwrap();
        c.get("a", 0u32).unwrap();
        assert_eq!(c.finish().unwrap_err().0, "unknown config keys: typo");
    }

    #[test]
    fn refuses_malformed_items() {
        assert!(Config::parse("novalue").is_err());
        assert!(Config::parse("a=1,a=2").is_err());
        let mut c = Config::parse("a=x").unwrap();
        assert!(c.get("a", 0u32).is_err());
    }
}
